"""The broker's web dashboard in headless Chromium: it shows the connected provider and a
running job, and updates by itself when the job finishes. Also writes the screenshot that
`make screenshot` copies into docs/img/."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.browser import Browser, find_chromium
from tests.helpers import LEASE_ARGS, Marketplace, training_job

pytestmark = pytest.mark.e2e

CHROMIUM = find_chromium()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install "
                    "chromium; .ci/run installs it)")
def test_dashboard_shows_providers_and_jobs_live(tmp_path):
    market = Marketplace(tmp_path)
    try:
        market.start_broker(*LEASE_ARGS, "--http", "127.0.0.1:0")
        http = "http://" + json.loads((tmp_path / "broker" / "broker.json").read_text())["http"]
        assert market.cli("keys", "init").returncode == 0
        market.start_provider("p1", 0.8)
        market.wait_for_offers(1)
        provider = market.provider_id("p1")
        asyncio.run(_drive(market, http, provider, tmp_path))
    finally:
        market.close()


async def _drive(market: Marketplace, http: str, provider: str, tmp_path: Path) -> None:
    async with Browser(CHROMIUM, tmp_path / "chromium") as page:
        await page.goto(http + "/")
        row = f'#providers tr[data-provider-id="{provider}"]'
        await page.wait_for(f"document.querySelector('{row}')", "the provider's row")
        assert await page.evaluate(f"document.querySelector('{row}').dataset.status") == "online"
        assert "live" in await page.evaluate("document.querySelector('#status').textContent")

        job_file = training_job(tmp_path / "job.toml", steps=300, checkpoint_every=100)
        r = await asyncio.to_thread(market.cli, "submit", str(job_file))
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.split()[0]
        job_row = f'#jobs tr[data-job-id="{job_id}"]'
        await page.wait_for(f"document.querySelector('{job_row}')?.dataset.state === 'RUNNING'",
                            "the job to show as RUNNING", timeout=120)
        assert await page.evaluate("document.querySelector('#c-gpus').textContent") == "1 / 1"
        await page.wait_for("document.querySelectorAll('#chart polyline').length === 2",
                            "the chart's two lines")
        await page.wait_for(f"document.querySelector('{job_row}')?.dataset.step > 0",
                            "the job's progress")
        await page.screenshot(tmp_path / "dashboard-running.png")
        # No reload: the page polls and redraws on its own.
        await page.wait_for(f"document.querySelector('{job_row}')?.dataset.state === "
                            "'SUCCEEDED'", "the job to show as SUCCEEDED", timeout=180)
        text = await page.evaluate(f"document.querySelector('{job_row}').textContent")
        assert "300/300" in text, text
        # The ledger section: each checkpoint's settlement, the release, the books balanced.
        await page.wait_for("document.querySelector('#ledger tr[data-type=\"release\"]')",
                            "the job's release in the ledger")
        settles = await page.evaluate(
            "document.querySelectorAll('#ledger tr[data-type=\"settle\"]').length")
        assert settles >= 3, settles
        assert "balanced" in await page.evaluate(
            "document.querySelector('#ledger-check').textContent")
        await page.screenshot(tmp_path / "dashboard.png")
    target = os.environ.get("GPUMARKET_SCREENSHOT_DIR")
    if target:
        shutil.copy(tmp_path / "dashboard-running.png", Path(target) / "dashboard.png")
