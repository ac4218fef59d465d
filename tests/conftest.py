from __future__ import annotations

import pytest

from tests.helpers import LEASE_ARGS, Marketplace


@pytest.fixture
def market(tmp_path):
    """A running broker and a client key; tests start the providers they need."""
    m = Marketplace(tmp_path)
    m.start_broker(*LEASE_ARGS)
    r = m.cli("keys", "init")
    assert r.returncode == 0, r.stderr
    yield m
    m.close()
    for name, proc in m.providers.items():
        text = proc.text()
        assert "Traceback" not in text, f"{name} logged a traceback:\n{text}"
    if m.broker is not None:
        assert "Traceback" not in m.broker.text(), m.broker.text()
