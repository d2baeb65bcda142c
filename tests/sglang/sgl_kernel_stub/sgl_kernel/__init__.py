"""A test-only stand-in for SGLang's compiled kernel package, so that its server starts on a
CPU without CUDA.

Why it exists: SGLang's server imports eight ``*_cpu`` functions from ``sgl_kernel`` at module
level on its startup path. The registry's ``sglang-kernel`` 0.4.10 wheel is the only build
of that package there, and it holds CUDA builds only: ``import sgl_kernel`` loads
``sgl_kernel/sm100/common_ops.abi3.so``, which needs the NVIDIA driver's ``libcuda.so.1``
("ImportError: libcuda.so.1: cannot open shared object file"), so it cannot import on a
machine without an NVIDIA driver. The eight functions serve speculative decoding and
KV-cache moves between memory pools, neither of which a plain CPU server with the torch
native attention backend uses; each one here raises if it is ever called, so a test that
reached one would fail loudly instead of computing something wrong.

``make sglang`` puts this directory on ``.venv-sglang``'s path (a ``.pth`` file); nothing
outside that virtualenv sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

__version__ = "0.0.0+asyncrl-test-stub"


def _missing(name: str) -> Callable[..., NoReturn]:
    def call(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this sgl_kernel is asyncrl's test-only "
            "stand-in (the registry's sglang-kernel wheel needs CUDA): the SGLang server "
            "took a path (speculative decoding or a KV-cache move) that the CPU tests do "
            "not support"
        )

    call.__name__ = name
    return call


assign_req_to_token_pool_cpu = _missing("assign_req_to_token_pool_cpu")
copy_all_layer_kv_cache_cpu = _missing("copy_all_layer_kv_cache_cpu")
assign_draft_cache_locs_contiguous_cpu = _missing("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _missing("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _missing("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _missing("fill_bonus_tokens_cpu")
build_tree_kernel_efficient_cpu = _missing("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _missing("verify_tree_greedy_cpu")
