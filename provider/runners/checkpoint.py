"""Training checkpoints: safetensors for tensors, JSON for the rest; never pickle.

A checkpoint is a directory written under a temporary name, fsynced, renamed into
place, and finished with a COMPLETE marker; a directory without the marker is
ignored, so a write killed halfway leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from gpumarket.provider.runners.base import MARKER, publish_checkpoint


def _optimizer_split(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for name, value in st.items():
            if torch.is_tensor(value):
                tensors[f"state.{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[name] = value
    return tensors, {"scalars": scalars, "param_groups": sd["param_groups"]}


def _optimizer_join(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    for pid, values in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(values)
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {"python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted(k for k in tensors if k.startswith("rng.cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save(root: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
         sched: Any, extra: dict) -> Path:
    """Write checkpoint ``root/step-NNNNNNNN`` atomically; return its path."""
    return publish_checkpoint(
        root, step, lambda tmp: write_files(tmp, step, model, opt, sched, extra))


def write_files(target: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                sched: Any, extra: dict) -> None:
    """The checkpoint's files, into ``target`` (the same bytes for the same state)."""
    save_model(model, str(target / "model.safetensors"))
    opt_tensors, opt_meta = _optimizer_split(opt)
    rng_tensors, rng_meta = rng_state()
    save_file({**opt_tensors, **rng_tensors}, str(target / "state.safetensors"))
    meta = {"step": step, "optimizer": opt_meta, "scheduler": sched.state_dict(),
            "rng": rng_meta, **extra}
    (target / "state.json").write_text(json.dumps(meta))


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``."""
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if (p / MARKER).exists())
    return done[-1] if done else None


def load(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict:
    """Restore everything saved by save(); return its JSON metadata."""
    if not (path / MARKER).exists():
        raise ValueError(f"{path.name} is not a complete checkpoint")
    meta = json.loads((path / "state.json").read_text())
    load_model(model, str(path / "model.safetensors"))
    tensors = load_file(str(path / "state.safetensors"))
    opt.load_state_dict(_optimizer_join(
        {k: v for k, v in tensors.items() if k.startswith("state.")}, meta["optimizer"]))
    sched.load_state_dict(meta["scheduler"])
    set_rng_state({k: v for k, v in tensors.items() if k.startswith("rng.")}, meta["rng"])
    return meta
