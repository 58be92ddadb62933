"""mha: multi-head attention — fast, exact, with PyTorch's conventions — on numpy arrays.

Functional API::

    out = mha.sdpa(q, k, v, causal=mha.Causal.top_left())            # q (B, h, T_q, d), k/v (B, kv, T_k, ·)
    out, lse = mha.sdpa(q, k, v, return_lse=True)
    dq, dk, dv = mha.sdpa_backward(q, k, v, out, d_out, lse)

The module (torch.nn.MultiheadAttention's constructor, forward, state_dict names)::

    m = mha.MultiheadAttention(512, 8, batch_first=True).eval()
    y, w = m(x, x, x, key_padding_mask=pad, is_causal=True)

With PyTorch installed, ``mha.torch`` holds a torch.nn.Module drop-in with autograd.
Bad input raises ValueError (shapes, values) or TypeError (types, dtypes) with the library's message.
"""
from ._core import cached_tensor_bytes, num_threads, release_cached_tensors, tensor_cache_limit
from ._functional import (Additive, Allowed, Causal, alibi_slopes, sdpa, sdpa_backward, sdpa_varlen, set_num_threads,
                          set_tensor_cache_limit)
from ._module import (KvCache, MultiheadAttention, PagedKvCache, Rope, analyze, attend_cache, attend_paged_cache,
                      head_importance, load_safetensors, prune_heads)

from ._version import __version__  # written by CMake: the project version

__all__ = ["sdpa", "sdpa_backward", "sdpa_varlen", "alibi_slopes", "Causal", "Allowed", "Additive", "MultiheadAttention",
           "KvCache", "PagedKvCache", "attend_cache", "attend_paged_cache", "Rope",
           "analyze", "prune_heads", "head_importance", "load_safetensors", "set_num_threads", "num_threads",
           "cached_tensor_bytes", "release_cached_tensors", "tensor_cache_limit", "set_tensor_cache_limit",
           "__version__"]
