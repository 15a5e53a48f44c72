"""The dtensor.mcore patches in one process: which modules they reach, what they leave
alone (everything that is not a DTensor), and the DCP view of chunks with prepended axes."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.checkpointable import (
    CheckpointableShardedTensor)
from megatron.core.package_info import __version__ as mcore_version
from packaging.version import Version
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Partial

from megatron_ckpt_fixes.integrations.mcore_dtensor import DTensorShardingError
from megatron_ckpt_fixes.core.importers import bound_imports, name_aliases, renamed_imports
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError

_MC = "megatron.core"
TP_IMPORTERS = {f"{_MC}.models.common.language_module.language_module",
                f"{_MC}.tensor_parallel.layers", f"{_MC}.transformer.multi_token_prediction",
                f"{_MC}.transformer.utils"}
if Version(mcore_version) >= Version("0.19"):
    TP_IMPORTERS |= {f"{_MC}.transformer.multi_latent_attention", f"{_MC}.ssm.mamba_mixer"}
if Version(mcore_version) >= Version("0.20"):
    TP_IMPORTERS |= {f"{_MC}.ssm.gated_delta_product"}


def test_every_module_that_imports_a_helper_by_name_is_an_alias():
    """0.16.1 has four modules that bind make_tp_sharded_tensor_for_checkpoint at import,
    0.19.2 six (multi-latent attention and the Mamba mixer), 0.20.0 seven (the gated delta
    product layer); generalized_tensor_parallelism
    imports both helpers inside a function, which needs no alias."""
    tp, replicated = "make_tp_sharded_tensor_for_checkpoint", "make_sharded_tensor_for_checkpoint"
    imports = bound_imports(_MC, f"{_MC}.utils", (tp, replicated))
    assert set(name_aliases(imports[tp], tp)) == TP_IMPORTERS
    assert set(name_aliases(imports[replicated], replicated)) == {
        f"{_MC}.transformer.moe.shared_experts", f"{_MC}.transformer.utils"}
    assert not renamed_imports(imports[tp], f"{_MC}.utils", tp)


def test_import_scan_resolves_relative_imports_and_skips_function_level_ones(tmp_path,
                                                                           monkeypatch):
    files = {
        "mcfpkg/__init__.py": "",
        "mcfpkg/utils.py": "def f():\n    return 1\n",
        "mcfpkg/a.py": "from mcfpkg.utils import f\n",
        "mcfpkg/sub/__init__.py": "from ..utils import f, other\n",
        "mcfpkg/sub/b.py": "def g():\n    from mcfpkg.utils import f\n    return f()\n",
        "mcfpkg/c.py": "try:\n    from .utils import f as h\nexcept ImportError:\n    pass\n",
        "mcfpkg/d.py": "# f is mentioned here only\nfrom . import utils\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    imports = bound_imports("mcfpkg", "mcfpkg.utils", ("f", "g"))
    assert name_aliases(imports["f"], "f") == ("mcfpkg.a", "mcfpkg.sub")
    assert renamed_imports(imports["f"], "mcfpkg.utils", "f") == [
        "mcfpkg.c imports mcfpkg.utils.f as 'h'; the patch would miss its callers"]
    assert imports["g"] == ()


def test_aliases_are_patched_and_restored(clean_install):
    from megatron.core import utils
    from megatron.core.tensor_parallel import layers

    original = utils.make_tp_sharded_tensor_for_checkpoint
    clean_install.install(["dtensor.mcore"])
    assert layers.make_tp_sharded_tensor_for_checkpoint is \
        utils.make_tp_sharded_tensor_for_checkpoint is not original
    clean_install.uninstall()
    assert layers.make_tp_sharded_tensor_for_checkpoint is original


def _fields(sh):
    return sh.without_data(), sh.data


@pytest.mark.parametrize("helper, args", [
    ("make_tp_sharded_tensor_for_checkpoint", dict(tp_axis=1, prepend_offsets=((0, 1, 3),))),
    ("make_sharded_tensor_for_checkpoint", dict(replica_id=(0, 0, 1))),
])
def test_tensors_that_are_not_dtensors_get_exactly_upstreams_result(clean_install,
                                                                    single_rank_group, helper,
                                                                    args):
    from megatron.core import utils

    tensor = torch.arange(6.0).reshape(2, 3)
    kwargs = dict(args, tp_group=dist.group.WORLD, dp_cp_group=dist.group.WORLD,
                  allow_shape_mismatch=True)
    upstream = getattr(utils, helper)(tensor, "w", **kwargs)
    clean_install.install(["dtensor.mcore"])
    patched = getattr(utils, helper)(tensor, "w", **kwargs)
    assert patched.without_data() == upstream.without_data()
    assert patched.data is upstream.data is tensor


def test_dtensor_keeps_its_local_shard_and_markers(clean_install, single_rank_group):
    from megatron.core import utils

    clean_install.install(["dtensor.mcore"])
    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(DTensor.from_local(torch.arange(6.0).reshape(2, 3), mesh,
                                                  [Shard(0)]))
    param.is_torch_fsdp2_param = True
    sh = utils.make_tp_sharded_tensor_for_checkpoint(param, "w", tp_axis=1,
                                                     tp_group=dist.group.WORLD,
                                                     dp_cp_group=dist.group.WORLD)
    assert sh.data.data_ptr() == param.to_local().data_ptr()  # no copy, no gather
    assert (sh.global_shape, sh.global_offset, sh.replica_id) == ((2, 3), (0, 0), (0, 0, 0))
    assert sh.is_torch_fsdp2_param is True


def test_a_dtensor_that_cannot_be_one_chunk_raises_a_valueerror_and_checkpointing_error(
        clean_install, single_rank_group):
    from megatron.core import utils

    clean_install.install(["dtensor.mcore"])
    partial = DTensor.from_local(torch.zeros(2, 3), init_device_mesh("cpu", (1,)), [Partial()])
    with pytest.raises(DTensorShardingError) as err:
        utils.make_sharded_tensor_for_checkpoint(partial, "layers.0.w",
                                                 tp_group=dist.group.WORLD,
                                                 dp_cp_group=dist.group.WORLD)
    assert isinstance(err.value, (ValueError, CheckpointingException, MegatronCkptFixesError))
    assert "'layers.0.w' on rank 0" in str(err.value)


def _prepended(data: torch.Tensor) -> ShardedTensor:
    """Rows 3:5 of expert 1 of a (2, 5, 4) tensor: uneven, so no regular grid."""
    return ShardedTensor("w", data, data.dtype, (2, 4), (2, 5, 4), (1, 3, 0), None, 0, 1)


def test_upstream_gives_chunks_with_prepended_axes_the_wrong_number_of_dims(clean_install):
    chunk = CheckpointableShardedTensor.from_sh_ten(_prepended(torch.zeros(2, 4)))
    assert tuple(chunk.__create_chunk_list__()[0].sizes) == (2, 4)  # of a 3-d tensor


def test_chunks_with_prepended_axes_reach_dcp_whole_and_unwrap_to_the_layer_tensor(
        clean_install):
    clean_install.install(["dtensor.mcore"])
    data = torch.arange(8.0).reshape(2, 4)
    wrapped = CheckpointableShardedTensor.from_sh_ten(_prepended(data))
    assert isinstance(wrapped, CheckpointableShardedTensor)
    chunk = wrapped.__create_chunk_list__()[0]
    assert (tuple(chunk.offsets), tuple(chunk.sizes)) == ((1, 3, 0), (1, 2, 4))
    item = wrapped.__create_write_items__("w", wrapped)[0]
    assert tuple(item.tensor_data.chunk.sizes) == (1, 2, 4)
    assert tuple(item.tensor_data.size) == (2, 5, 4)
    view = wrapped.__get_tensor_shard__(item.index)
    assert view.shape == (1, 2, 4) and view.data_ptr() == data.data_ptr()
    assert mcore_torch._unwrap_pyt_sharded_tensor(wrapped)[0] is data
    flat = ShardedTensor("v", data, data.dtype, (2, 4), (3, 4), (1, 0), None, 0, 0)
    assert type(CheckpointableShardedTensor.from_sh_ten(flat)) is CheckpointableShardedTensor
