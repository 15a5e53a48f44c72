"""MLite's own checkpoint code on CPU/gloo ranks: what the ``dtensor.mlite`` tests run.

Everything that saves and loads is MLite's, unchanged, from a snapshot tree
(``scripts/upstream_snapshots.py``): ``init_parallel`` builds the process groups,
``wrap_fsdp2``/``wrap_fsdp2_module`` shard the parameters with FSDP2 exactly as its FSDP2
optimizer builder does (experts over the expert-data-parallel group, the rest over dp x cp,
each with its own ``build_fsdp2_shard_placement_fn``), DeepSeek-V4's ``PLACEMENT_FN`` and
``EXPERT_CLASSIFIER`` describe the layout, and ``save_training_checkpoint`` /
``load_training_checkpoint`` do the work. The model is a module with DeepSeek-V4's parameter
names and small shapes (MLite's real models need Transformer Engine).

What this harness changes to run on CPU, and counts:

- ``_build_meshes`` builds ``DeviceMesh("cuda", ...)``: the name ``DeviceMesh`` in MLite's
  checkpoint module is replaced by a CPU one (:func:`cpu_meshes`), each mapping counted.
- DeepSeek-V4's ``lite`` package imports its model (Transformer Engine) in ``__init__``; its
  ``checkpoint`` module, which holds ``PLACEMENT_FN``, needs none of it, so the package is
  registered without running that ``__init__`` (:func:`deepseek_v4_rules`).
- MLite PR 61's tree differs from ``dev`` in ``primitive/ckpt/dcp.py`` (and in model files):
  its ``dcp.py`` is loaded as a module of its own next to ``dev``'s (:func:`pr61_dcp`).

Values: every key has a known global checkpoint tensor (:class:`Truth`): an expert key
``layers.L.mlp.experts.fcJ.weightI`` holds local expert I of every expert-parallel rank,
stacked (MLite's layout), a dense key the whole weight, split over tensor parallelism where
DeepSeek-V4's rules say so. Each rank builds its parameters from it, and after a load every
rank compares its FSDP2 shard with the block its own mesh and placements say it holds
(max delta 0.0), and reads every saved key back whole.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

N_EXPERTS = 8
#: Per-expert (rows, cols) of fc1 and fc2 in two expert layers. FSDP2 over expert-dp 2
#: shards dim 0 of each: layer 0's fc2 unevenly (3 + 2 rows), layer 1's fc2 leaves expert-dp
#: rank 1 empty (1 + 0 rows). ``EVEN`` has only even shards (what PR 61 handles).
EXPERTS = {0: ((6, 5), (5, 3)), 1: ((6, 1), (1, 3))}
EXPERTS_EVEN = {0: ((6, 4), (4, 2))}
#: Dense keys -> whole shape: the embedding is split over TP (DeepSeek-V4: "embed" ->
#: Shard(0)), hc_head is whole on every TP rank (the "head" rule catches it upstream),
#: the rest replicated. Over dp 3, attn_hc leaves rank 2 empty.
DENSE = {"embed_tokens.embedding.weight": (8, 3), "hc_head.hc_fn": (3, 5),
         "layers.0.attn_hc.hc_fn": (2, 5), "norm.weight": (5,)}


# ----------------------------------------------------------------------- loading MLite
def use_tree(root: str) -> None:
    """Put an MLite import root (``<tree>/experimental/lite``) first on ``sys.path``."""
    if root not in sys.path:
        sys.path.insert(0, root)


_MAPPED = {"meshes": 0}


def cpu_meshes() -> dict[str, int]:
    """Make ``_build_meshes`` build CPU meshes (see the module docstring); returns the
    counter of meshes mapped so far."""
    from torch.distributed.device_mesh import DeviceMesh

    module = importlib.import_module("megatron.lite.primitive.ckpt.dcp")

    def cpu_mesh(device_type: str, *args, **kwargs) -> DeviceMesh:
        _MAPPED["meshes"] += device_type == "cuda"
        return DeviceMesh("cpu", *args, **kwargs)

    module.DeviceMesh = cpu_mesh
    return _MAPPED


def deepseek_v4_rules(package: str = "megatron.lite.model.deepseek_v4") -> SimpleNamespace:
    """DeepSeek-V4's real ``PLACEMENT_FN`` and ``EXPERT_CLASSIFIER`` (see the docstring)."""
    parent = importlib.import_module(package)
    lite = f"{package}.lite"
    if lite not in sys.modules:
        stub = types.ModuleType(lite)
        stub.__path__ = [str(Path(parent.__path__[0]) / "lite")]
        sys.modules[lite] = stub
    ckpt = importlib.import_module(f"{lite}.checkpoint")
    return SimpleNamespace(placements=ckpt.PLACEMENT_FN, is_expert=ckpt.EXPERT_CLASSIFIER)


def pr61_dcp(pr61_root: str) -> types.ModuleType:
    """PR 61's ``primitive/ckpt/dcp.py`` as module ``mlite_pr61_dcp`` (its imports resolve
    to the ``dev`` tree's unchanged ``parallel`` and ``protocols``), on CPU meshes."""
    from torch.distributed.device_mesh import DeviceMesh

    name = "mlite_pr61_dcp"
    if name not in sys.modules:
        path = Path(pr61_root) / "megatron" / "lite" / "primitive" / "ckpt" / "dcp.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)

        def cpu_mesh(device_type: str, *args, **kwargs) -> DeviceMesh:
            _MAPPED["meshes"] += device_type == "cuda"
            return DeviceMesh("cpu", *args, **kwargs)

        module.DeviceMesh = cpu_mesh
    return sys.modules[name]


# ----------------------------------------------------------------------- model and truth
def _values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Distinct, exactly representable values per key."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) \
        + 1000.0 * seed


@dataclass
class Truth:
    """The global checkpoint tensor of every key, for a layout (tp, ep)."""

    tp: int
    ep: int
    experts: dict = field(default_factory=lambda: EXPERTS)
    dense: bool = False

    def keys(self) -> dict[str, torch.Tensor]:
        out = {}
        seed = 1
        if self.dense:
            for name, shape in DENSE.items():
                out[name] = _values(shape, seed)
                seed += 1
            return out
        local = N_EXPERTS // self.ep
        for layer, shapes in self.experts.items():
            for j, (rows, cols) in enumerate(shapes, start=1):
                for i in range(local):
                    # expert e*local + i of EP rank e is rows [e*rows, (e+1)*rows)
                    out[f"layers.{layer}.mlp.experts.fc{j}.weight{i}"] = torch.cat(
                        [_values((rows, cols), 10 * (e * local + i) + j + 100 * layer)
                         for e in range(self.ep)])
        return out

    def local(self, name: str, full: torch.Tensor, ps, rules) -> torch.Tensor:
        """What this rank holds of ``full`` before FSDP2: its EP rank's expert, or its TP
        chunk along the dim DeepSeek-V4's rule shards over TP (the last mesh axis)."""
        if rules.is_expert(name):
            return full.chunk(self.ep)[ps.ep_rank]
        tp_placement = rules.placements(name)[3]
        if tp_placement.is_shard() and "hc_head" not in name:
            return full.chunk(self.tp, dim=tp_placement.dim)[ps.tp_rank]
        return full


def _module_at(root: torch.nn.Module, path: list[str]) -> torch.nn.Module:
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    return root


def build_model(truth: Truth, ps, rules, fsdp: bool = True) -> tuple[torch.nn.Module, dict]:
    """The model with this rank's values, FSDP2-sharded as MLite's FSDP2 builder does;
    returns (model, name -> full global tensor)."""
    from megatron.lite.primitive.optimizers.fsdp2 import (FSDP2Config,
                                                          build_fsdp2_process_group_mesh,
                                                          build_fsdp2_shard_placement_fn,
                                                          wrap_fsdp2, wrap_fsdp2_module)

    model = torch.nn.Module()
    fulls = truth.keys()
    for name, full in fulls.items():
        *path, leaf = name.split(".")
        local = truth.local(name, full, ps, rules).clone()
        _module_at(model, path).register_parameter(leaf, torch.nn.Parameter(local))
    if not fsdp:
        return model, fulls
    config = FSDP2Config(device_type="cpu")
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    if experts and ps.ep_size > 1:
        mesh = build_fsdp2_process_group_mesh(ps.ep_dp_group, mesh_dim_name="expert_dp",
                                              device_type="cpu")
        for module in experts:
            wrap_fsdp2_module(module, ps, config, mesh=mesh,
                              shard_placement_fn=build_fsdp2_shard_placement_fn(
                                  ps.expert_dp_size))
    ignored = {p for m in experts for p in m.parameters()} if ps.ep_size > 1 else None
    wrap_fsdp2(model, ps, config, ignored_params=ignored,
               shard_placement_fn=build_fsdp2_shard_placement_fn(ps.dp_cp_size))
    return model, fulls


@functools.lru_cache(maxsize=None)
def parallel(tp: int, ep: int, pp: int = 1):
    """MLite's own process groups for (tp, ep, pp) on this world (once per spawn: each call
    of ``init_parallel`` creates every group again)."""
    from megatron.lite.primitive.parallel import init_parallel

    config = SimpleNamespace(tp=tp, ep=ep, etp=1, cp=1, pp=pp)
    return config, init_parallel(config)


# ----------------------------------------------------------------------- checks
def block(param: torch.Tensor, local_full: torch.Tensor) -> torch.Tensor:
    """The part of ``local_full`` (the parameter's unsharded value) that ``param`` holds on
    this rank, by its own mesh and placements (torch's rule, not the code under test)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return local_full
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    return local_full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def local_of(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def zero(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            local_of(param).fill_(-1.0)


def wrong_keys(model: torch.nn.Module, fulls: dict, truth: Truth, ps, rules) -> dict:
    """name -> max delta of every parameter whose loaded shard differs from what it should
    hold (empty: exact on this rank)."""
    out = {}
    for name, param in model.named_parameters():
        expected = block(param, truth.local(name, fulls[name], ps, rules))
        got = local_of(param)
        if got.shape != expected.shape or not torch.equal(got, expected):
            out[name] = (float((got - expected).abs().max()) if got.shape == expected.shape
                         and got.numel() else f"shape {list(got.shape)} vs "
                                              f"{list(expected.shape)}")
    return out


def experts_loaded(model: torch.nn.Module, fulls: dict, truth: Truth, ps, rules) -> list:
    """For each local expert slot of layer 0's fc1: which global expert's values this rank
    holds now (None: none)."""
    local = N_EXPERTS // truth.ep
    found = []
    for i in range(local):
        name = f"layers.0.mlp.experts.fc1.weight{i}"
        param = dict(model.named_parameters())[name]
        hit = None
        for e in range(truth.ep):
            candidate = fulls[name].chunk(truth.ep)[e]
            if torch.equal(local_of(param), block(param, candidate)):
                hit = e * local + i
        found.append(hit)
    return found


def read_back(path: str, fulls: dict, prefix: str = "model") -> dict:
    """Every key of checkpoint ``path`` read whole (on every rank): key -> max delta from the
    truth, or the saved global shape where it differs."""
    reader = dcp.FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    out = {}
    for name, full in fulls.items():
        key = f"{prefix}.{name}"
        size = tuple(saved[key].size)
        if size != tuple(full.shape):
            out[name] = f"saved shape {list(size)}"
            continue
        whole = {key: torch.zeros_like(full)}
        dcp.load(whole, checkpoint_id=path)
        if not torch.equal(whole[key], full):
            out[name] = float((whole[key] - full).abs().max())
    return out


def saved_size(path: str, key: str) -> tuple[int, ...]:
    return tuple(dcp.FileSystemReader(path).read_metadata().state_dict_metadata[key].size)


def round_trip(api, path: str, truth: Truth, tp: int, ep: int, rules, *, save: bool = True,
               fsdp: bool = True, step: int = 1, pp: int = 1) -> dict:
    """Build at (tp, ep, pp), save with ``api`` (a module with save/load_training_checkpoint)
    unless ``save`` is false, zero, load, check. Errors are reported, not raised."""
    config, ps = parallel(tp, ep, pp)
    model, fulls = build_model(truth, ps, rules, fsdp=fsdp)
    out: dict = {}
    kwargs = dict(get_placements=rules.placements, is_expert=rules.is_expert)
    try:
        if save:
            api.save_training_checkpoint(model, None, step, path, config, ps, save_rng=False,
                                         **kwargs)
        zero(model)
        api.load_training_checkpoint(model, None, path, config, ps, load_rng=False, **kwargs)
    except BaseException as exc:  # CheckpointException derives from BaseException
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["wrong"] = wrong_keys(model, fulls, truth, ps, rules)
    if not truth.dense:
        out["experts"] = experts_loaded(model, fulls, truth, ps, rules)
    out["read_back"] = read_back(f"{path}/step_{step}", fulls)
    out["values"] = {n: local_of(p).clone() for n, p in model.named_parameters()}
    dist.barrier()
    return out
