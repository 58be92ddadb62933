"""The multi-head attention module on numpy arrays, with torch.nn.MultiheadAttention's conventions."""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core
from ._functional import (_finite, _i64, _name, _named_errors, _narrowed, _number, _offsets, _optional_count,
                          _per_head, _probability, _score_edit_values, _seed, _splits, _threads)

__all__ = ["Rope", "MultiheadAttention", "KvCache", "PagedKvCache", "attend_cache", "attend_paged_cache", "analyze",
           "prune_heads", "head_importance", "load_safetensors"]

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class Rope:
    """Rotary position embeddings on Q and K after projection.

    Args:
        theta: base θ (10000 in most models).
        dims: rotated features per head (even, ≤ head dim); 0 = all.
        pairing: ``"half_split"`` (Llama / GPT-NeoX rotate_half) or ``"interleaved"`` (GPT-J).
    """

    theta: float = 10000.0
    dims: int = 0
    pairing: str = "half_split"

    def __post_init__(self) -> None:
        # Checked here, so that dims=2.7 is not truncated to 2 on its way to the library, and a
        # dims beyond 64 bits is named instead of listed among the binding's arguments.
        _i64("Rope", "dims", self.dims)
        if isinstance(self.theta, (bool, np.bool_)) or not isinstance(self.theta, (int, float, np.integer, np.floating)):
            raise TypeError(f"Rope: theta must be a number, got {type(self.theta).__name__}")
        if not isinstance(self.pairing, str):
            raise TypeError(f"Rope: pairing must be a str, got {type(self.pairing).__name__}")


def _numpy(x: Any) -> np.ndarray:
    """A numpy view of an array-like; torch tensors are detached (CPU only)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu()
        if str(getattr(x, "dtype", "")) == "torch.bfloat16":
            x = x.float()  # numpy has no bfloat16; every bf16 value is exactly a float32 one
        x = x.numpy()
    return np.asarray(x)


def _f32(name: str, x: Any, fn: str) -> np.ndarray:
    if x is None:
        raise TypeError(f"{fn}: {name} must be an array, got None")
    a = _numpy(x)
    if a.dtype.kind != "f":
        raise TypeError(f"{fn}: {name} must be a floating-point array, got dtype {a.dtype}")
    return a if a.dtype == np.float32 else _narrowed(name, a, fn)


def _f32_contiguous(name: str, x: Any, fn: str) -> np.ndarray:
    """x (a floating-point array, _f32) as a C-contiguous float32 array, copied only if needed."""
    return np.ascontiguousarray(_f32(name, x, fn), dtype=np.float32)


def _is_bool(a: np.ndarray) -> bool:
    # torch 1.13 still accepts uint8 masks as boolean ones (deprecated); so do we.
    return a.dtype == np.bool_ or a.dtype == np.uint8


def _forward_args(fn: str, key_padding_mask: Any, attn_mask: Any, is_causal: bool, need: str, training: bool,
                  seed: int, threads: int) -> "_core.ForwardArgs":
    args = _core.ForwardArgs()
    if attn_mask is not None:
        m = _numpy(attn_mask)
        if _is_bool(m):
            # PyTorch's polarity (True = may NOT attend), as it is: the binding negates it into
            # mha's "allowed" in the one pass that copies it into the library's mask, reading it in
            # place whatever its strides (np.logical_not here made a second mask-sized copy).
            args.attn_masked_out = m
        elif m.dtype.kind == "f":
            # float16/float64 become float32 here, where a finite value past float32's range is a
            # ValueError naming the mask and its index, as for every other array: the binding's
            # cast made it ±inf silently (1e300 gave NaN rows, -1e300 fully masked ones).
            args.attn_additive = _f32("attn_mask", m, fn)
        else:
            raise TypeError(f"{fn}: attn_mask must be a bool or float array, got dtype {m.dtype}")
    if key_padding_mask is not None:
        m = _numpy(key_padding_mask)
        if _is_bool(m):
            args.key_padding = m  # read in place, nonzero = padding, as attn_mask
        elif m.dtype.kind == "f":
            args.key_bias = _f32("key_padding_mask", m, fn)
        else:
            raise TypeError(f"{fn}: key_padding_mask must be a bool or float array, got dtype {m.dtype}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{fn}: is_causal must be a bool, got {type(is_causal).__name__}")
    args.is_causal = bool(is_causal)
    args.need_weights = need
    args.training = training
    args.seed = _seed(fn, "dropout_seed", seed)
    args.threads = _threads(fn, threads)
    return args


def _finite_sinks(fn: str, core: "_core.Module") -> None:
    """A ValueError naming the parameter when a module's sink logits (attention_sinks) are not all
    finite: refused where they are loaded, since every later call would fail on them with the
    library's message, which names an "sdpa" the caller never called."""
    if "sinks" in core.param_names():
        _finite(fn, "sinks", core.get("sinks").tolist())


def _i64s(fn: str, **named: Any) -> List[int]:
    """Each named integer argument (sizes, indices) as :func:`_i64` checks it, in the order given."""
    return [_i64(fn, n, x) for n, x in named.items()]


def _i64_list(fn: str, name: str, values: Optional[Iterable[Any]]) -> List[int]:
    """A list of integers (positions, lengths, ids) each as :func:`_i64` checks it; None gives [].
    Tested with ``is None``: ``values or []`` dropped np.array([0]) and refused longer arrays."""
    return [] if values is None else [_i64(fn, name, x) for x in values]


class KvCache:
    """A key/value cache for one attention layer (see :meth:`MultiheadAttention.new_cache`).

    Preallocated (batch, kv_heads, capacity, d) in float32, bfloat16 or int8 (``dtype="int8"``:
    one float scale per token and K/V head, max|x|/127; appending a non-finite value raises
    ValueError; ``int8_keys="per-channel"``: keys get one scale per channel of each group of
    ``key_group`` positions instead, as in KIVI, for non-ring caches); ``key_layout="transposed"``
    stores keys across SIMD lanes (tiles of 16 positions, each channel's 16 values together: the
    decode kernel then needs no horizontal sums; faster for every dtype, same values; not with
    per-channel key scales); each sequence has its own
    length. ``ring=True`` keeps the last ``capacity`` positions (sliding-window decoding);
    ``sinks=n`` (with ``ring``) also keeps positions 0 … n−1 for good, visible to every query
    whatever the window (StreamingLLM attention sinks; keys keep their original RoPE positions).
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, capacity: int, *, value_dim: int = 0,
                 dtype: str = "f32", ring: bool = False, sinks: int = 0, int8_keys: str = "per-token",
                 key_group: int = 32, key_layout: str = "rows"):
        fn = "KvCache"
        sizes = _i64s(fn, batch=batch, kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim, capacity=capacity)
        self._c = _core.KvCache(*sizes, _name(fn, "dtype", dtype), bool(ring), _i64(fn, "sinks", sinks),
                                _name(fn, "int8_keys", int8_keys), _i64(fn, "key_group", key_group),
                                _name(fn, "key_layout", key_layout))

    def length(self, b: int = 0) -> int:
        """Absolute length of sequence ``b`` (the position of its next token)."""
        return self._c.length(_i64("KvCache.length", "b", b))

    def lengths(self) -> List[int]:
        """Every sequence's length."""
        return [self._c.length(b) for b in range(self._c.batch)]

    def stored(self, b: int = 0) -> int:
        """Positions sequence ``b`` holds (less than its length once a ring has wrapped)."""
        return self._c.stored(_i64("KvCache.stored", "b", b))

    def remaining(self, b: int = 0) -> int:
        """Positions sequence ``b`` can still take before :meth:`append` fails (a ring: unlimited)."""
        return self._c.remaining(_i64("KvCache.remaining", "b", b))

    @property
    def batch(self) -> int:
        return self._c.batch

    @property
    def capacity(self) -> int:
        return self._c.capacity

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage."""
        return self._c.nbytes

    def append(self, k: Any, v: Any, counts: Optional[Sequence[int]] = None) -> None:
        """Appends ``counts[b]`` rows of k (B, kv_heads, T, d) / v (B, kv_heads, T, d_v) to each
        sequence b, at positions length … length + counts[b] − 1 (default: all T rows of every
        sequence) — K and V as your own projections (and RoPE) made them, for :func:`attend_cache`.
        Raises ValueError, changing nothing, on a shape that does not match, a sequence that would
        outgrow a non-ring cache, or a non-finite value for an int8 cache."""
        fn = "KvCache.append"
        ka = _f32_contiguous("k", k, fn)
        va = _f32_contiguous("v", v, fn)
        if ka.ndim != 4 or va.ndim != 4:
            raise ValueError(f"{fn}: k and v must be 4-D (B, kv_heads, T, d), got shapes {ka.shape} and {va.shape}")
        self._c.append(ka, va, _i64_list(fn, "counts", counts))

    def k_at(self, b: int, g: int, p: int, x: int) -> float:
        """Element x of the key of sequence b, K/V head g, position p, as stored (int8 and bf16:
        read back as float)."""
        return self._c.k_at(*_i64s("KvCache.k_at", b=b, g=g, p=p, x=x))

    def v_at(self, b: int, g: int, p: int, x: int) -> float:
        """Element x of the value of sequence b, K/V head g, position p, as stored."""
        return self._c.v_at(*_i64s("KvCache.v_at", b=b, g=g, p=p, x=x))

    def reset(self, b: Optional[int] = None) -> None:
        """Every sequence (or sequence ``b``) back to length 0."""
        if b is None:
            self._c.reset()
        else:
            self._c.reset_sequence(_i64("KvCache.reset", "b", b))

    def clone(self) -> "KvCache":
        """A deep copy (e.g. to branch a shared prompt)."""
        c = KvCache.__new__(KvCache)
        c._c = self._c.clone()
        return c

    def __repr__(self) -> str:
        return f"mha.KvCache(batch={self.batch}, capacity={self.capacity}, lengths={self.lengths()})"


class PagedKvCache:
    """A paged key/value cache for one attention layer (vLLM's PagedAttention; C++ mha::PagedKvCache).

    K/V live in a pool of ``num_blocks`` blocks of ``block_size`` positions, allocated once; each
    sequence is a block table that grows a block at a time. :meth:`fork` makes a sequence sharing
    every block of its parent (nothing copied); writing into a shared, partly filled last block
    copies that one block first (copy-on-write). ``key_layout="transposed"`` keeps each block's
    keys across SIMD lanes (see :class:`KvCache`; ``block_size`` a multiple of 16). Use it with
    ``MultiheadAttention.forward_incremental(q, k, v, cache, seqs=[…])``.
    """

    def __init__(self, kv_heads: int, head_dim: int, block_size: int = 16, *, num_blocks: int,
                 value_dim: int = 0, dtype: str = "f32", key_layout: str = "rows"):
        fn = "PagedKvCache"
        sizes = _i64s(fn, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, num_blocks=num_blocks,
                      value_dim=value_dim)
        self._c = _core.PagedKvCache(*sizes, _name(fn, "dtype", dtype), _name(fn, "key_layout", key_layout))

    def add_sequence(self) -> int:
        """A new empty sequence; returns its id (ids of freed sequences are reused)."""
        return self._c.add_sequence()

    def fork(self, seq: int) -> int:
        """A new sequence holding the same positions as ``seq``, sharing its blocks."""
        return self._c.fork(_i64("PagedKvCache.fork", "seq", seq))

    def free(self, seq: int) -> None:
        """Releases ``seq``; its blocks no other sequence holds return to the pool."""
        self._c.free(_i64("PagedKvCache.free", "seq", seq))

    def length(self, seq: int) -> int:
        """Positions sequence ``seq`` holds (the position of its next token)."""
        return self._c.length(_i64("PagedKvCache.length", "seq", seq))

    def append(self, seq: int, k: Any, v: Any) -> None:
        """Appends k (kv_heads, T, d) / v (kv_heads, T, d_v) (or with a leading 1) to sequence
        ``seq`` at positions length … length + T − 1, taking blocks from the pool as needed (a
        shared last block is copied first). Raises ValueError, changing nothing, when the pool has
        too few free blocks, a shape does not match or ``seq`` does not exist."""
        fn = "PagedKvCache.append"
        ka = _f32_contiguous("k", k, fn)
        va = _f32_contiguous("v", v, fn)
        if ka.ndim == 3 and va.ndim == 3:
            ka, va = ka[None], va[None]
        if ka.ndim != 4 or va.ndim != 4:
            raise ValueError(f"{fn}: k and v must be (kv_heads, T, d) or (1, kv_heads, T, d), "
                             f"got shapes {ka.shape} and {va.shape}")
        self._c.append(_i64(fn, "seq", seq), ka, va)

    def k_at(self, seq: int, g: int, p: int, x: int) -> float:
        """Element x of the key of sequence ``seq``, K/V head g, position p, as stored."""
        return self._c.k_at(*_i64s("PagedKvCache.k_at", seq=seq, g=g, p=p, x=x))

    def v_at(self, seq: int, g: int, p: int, x: int) -> float:
        """Element x of the value of sequence ``seq``, K/V head g, position p, as stored."""
        return self._c.v_at(*_i64s("PagedKvCache.v_at", seq=seq, g=g, p=p, x=x))

    def alive(self, seq: int) -> bool:
        return self._c.alive(_i64("PagedKvCache.alive", "seq", seq))

    def block_table(self, seq: int) -> List[int]:
        """The pool blocks holding ``seq``'s positions, in order."""
        return self._c.block_table(_i64("PagedKvCache.block_table", "seq", seq))

    def free_blocks(self) -> int:
        return self._c.free_blocks()

    def refcount(self, block: int) -> int:
        """How many live sequences hold pool block ``block``."""
        return self._c.refcount(_i64("PagedKvCache.refcount", "block", block))

    @property
    def block_size(self) -> int:
        return self._c.block_size

    @property
    def num_blocks(self) -> int:
        return self._c.num_blocks

    def __repr__(self) -> str:
        return (f"mha.PagedKvCache(block_size={self.block_size}, num_blocks={self.num_blocks}, "
                f"free_blocks={self.free_blocks()})")


def _cache_query(fn: str, q: Any, cache: Any, kind: type) -> np.ndarray:
    """q as a C-contiguous float32 (B, h, T_q, d) array, once cache is checked to be a `kind`."""
    if not isinstance(cache, kind):
        raise TypeError(f"{fn}: cache must be an mha.{kind.__name__}, got {type(cache).__name__}")
    a = _f32_contiguous("q", q, fn)
    if a.ndim != 4:
        raise ValueError(f"{fn}: q must be 4-D (B, h, T_q, d), got shape {a.shape}")
    return a


def _cache_options(fn: str, scale: Any, window: Any, splits: Any, threads: Any, alibi_slopes: Any, softcap: Any,
                   sinks: Any) -> Tuple[Any, ...]:
    """attend_cache's and attend_paged_cache's options in the binding's order, each checked as
    :func:`mha.sdpa` checks it (types and finiteness here; lengths by the library, as ValueError)."""
    return (None if scale is None else _number(fn, "scale", scale), _i64(fn, "window", window), _splits(fn, splits),
            _threads(fn, threads), *_score_edit_values(fn, alibi_slopes, softcap, sinks))


def attend_cache(q: Any, cache: KvCache, *, q_start: Optional[Sequence[int]] = None, scale: Optional[float] = None,
                 window: int = 0, splits: int = 0, threads: int = 0, alibi_slopes: Optional[Any] = None,
                 softcap: float = 0.0, sinks: Optional[Any] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Causal attention of q (B, h, T_q, d) against everything ``cache`` holds (C++
    mha::attend_cache; the decode kernel): row t of batch b is at position ``q_start[b] + t``
    (default: the sequence's length, right after the cache) and sees cached positions ≤ it (and
    > it − window). Query head i reads K/V head i // (h // kv_heads). ``splits`` cuts each
    sequence's positions into that many parts merged exactly (0: chosen from the shapes); the
    result never depends on ``threads``. Returns ``(out (B, h, T_q, d_v), lse (B, h, T_q))``; a
    row that sees no key gives zeros and lse = −inf (with ``sinks``: zeros and lse = the sink).

    Score edits, as :func:`mha.sdpa` takes them (``CacheAttentionOptions``): ``alibi_slopes`` (one
    per query head) adds ``−m_h·(q_pos − k_pos)`` by absolute positions, so decoding token by
    token gives the scores of the full causal forward; ``softcap`` c > 0 caps the scaled scores,
    ``s → c·tanh(s/c)``, before ALiBi; ``sinks`` (one logit per query head, gpt-oss) join each
    row's softmax denominator without a value, and the lse includes them. (These sink logits are
    not the cache's ``sinks=n``, the StreamingLLM positions a ring keeps.) A wrong length or a
    non-finite value raises ValueError."""
    fn = "attend_cache"
    a = _cache_query(fn, q, cache, KvCache)
    return _core.attend_cache(a, cache._c, _i64_list(fn, "q_start", q_start),
                              *_cache_options(fn, scale, window, splits, threads, alibi_slopes, softcap, sinks))


def attend_paged_cache(q: Any, cache: PagedKvCache, seqs: Sequence[int], *, q_start: Optional[Sequence[int]] = None,
                       scale: Optional[float] = None, window: int = 0, splits: int = 0, threads: int = 0,
                       alibi_slopes: Optional[Any] = None, softcap: float = 0.0,
                       sinks: Optional[Any] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Causal attention of q (B, h, T_q, d) against sequences ``seqs`` of a paged cache (C++
    mha::attend_paged_cache): row t of batch b is at position ``q_start[b] + t`` (default: the
    sequence's length, right after the cache) and sees cached positions ≤ it (and > it − window).
    ``alibi_slopes``, ``softcap`` and ``sinks`` as :func:`attend_cache`. Returns
    ``(out (B, h, T_q, d_v), lse (B, h, T_q))``, bitwise those of :func:`attend_cache` over a
    contiguous cache of the same values with the same split count."""
    fn = "attend_paged_cache"
    a = _cache_query(fn, q, cache, PagedKvCache)
    return _core.attend_paged_cache(a, cache._c, _i64_list(fn, "seqs", seqs), _i64_list(fn, "q_start", q_start),
                                    *_cache_options(fn, scale, window, splits, threads, alibi_slopes, softcap, sinks))


class MultiheadAttention:
    """Multi-head attention with torch.nn.MultiheadAttention's constructor, forward and parameter names.

    ``MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
    add_zero_attn=False, kdim=None, vdim=None, batch_first=False)`` takes PyTorch's arguments in
    PyTorch's order, plus keyword-only extras: ``num_kv_heads`` (grouped-query / multi-query
    attention: query head i uses K/V head ``i // (num_heads // num_kv_heads)``), ``rope``
    (:class:`mha.Rope`) and ``seed`` (the deterministic initialisation: Xavier-uniform projections,
    zero biases, as PyTorch initialises them).

    Inputs are numpy arrays (or anything ``np.asarray`` accepts): (T, B, E) by default,
    (B, T, E) with ``batch_first=True``, (T, E) unbatched. Like a torch module it starts in
    training mode; dropout (if > 0) applies only then. Call :meth:`eval` for inference.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device: Any = None, dtype: Any = None, *,
                 num_kv_heads: Optional[int] = None, rope: Optional[Rope] = None, seed: int = 0,
                 scale: Optional[float] = None, alibi_slopes: Optional[Any] = None, softcap: float = 0.0,
                 attention_sinks: bool = False):
        fn = "MultiheadAttention"
        embed_dim, num_heads = _i64(fn, "embed_dim", embed_dim), _i64(fn, "num_heads", num_heads)
        if device not in (None, "cpu") and str(device) != "cpu":
            raise ValueError(f"MultiheadAttention: mha computes on the CPU; device={device!r} is not supported")
        if dtype is not None and str(dtype) not in ("float32", "torch.float32", "<class 'numpy.float32'>", "f32"):
            raise TypeError(f"MultiheadAttention: parameters are float32; dtype={dtype!r} is not supported")
        if rope is not None and not isinstance(rope, Rope):
            raise TypeError(f"MultiheadAttention: rope must be an mha.Rope or None, got {type(rope).__name__}")
        widths = [_optional_count(fn, name, val, default) for name, val, default in
                  (("num_kv_heads", num_kv_heads, "num_heads"), ("kdim", kdim, "embed_dim"), ("vdim", vdim, "embed_dim"))]
        p = 0.0 if dropout is False else _probability(fn, "dropout", _number(fn, "dropout", dropout))  # as torch
        # The configuration's errors name this constructor, not the C++ MhaConfig that checks them.
        with _named_errors(fn, ("MhaConfig",)):
            self._m = _core.Module(embed_dim, num_heads, *widths, bool(bias), bool(add_bias_kv), bool(add_zero_attn),
                                   p, bool(batch_first), rope is not None, float(rope.theta if rope else 10000.0),
                                   int(rope.dims if rope else 0), str(rope.pairing if rope else "half_split"), 0,
                                   _seed(fn, "seed", seed))
            softcap = 0.0 if softcap is None else _number(fn, "softcap", softcap)
            if scale is not None or alibi_slopes is not None or softcap or attention_sinks:
                # Softmax scale (default 1/sqrt(d)), ALiBi slopes (mha.alibi_slopes(h) for the standard
                # schedule), logit softcap c > 0, learned sink logits (parameter "sinks", zeros at init).
                slopes = [] if alibi_slopes is None else _per_head("alibi_slopes", alibi_slopes, fn)
                self._m = self._m.with_score_options(slopes, softcap, bool(attention_sinks),
                                                     None if scale is None else _number(fn, "scale", scale))
        self.training = True
        self.dropout_seed = 0

    @classmethod
    def _wrap(cls, core: "_core.Module") -> "MultiheadAttention":
        m = cls.__new__(cls)
        m._m = core
        m.training = True
        m.dropout_seed = 0
        return m

    # ---- configuration, like torch's attributes ----------------------------------------------
    @property
    def deterministic(self) -> bool:
        """Always True: every path gives bitwise the same results run after run and for any
        thread count (docs/semantics.md, 'Determinism'); there is no non-deterministic mode."""
        return True

    @property
    def config(self) -> Dict[str, Any]:
        """The configuration as a dict (embed_dim, num_heads, num_kv_heads, kdim, vdim, …)."""
        return self._m.config()

    embed_dim = property(lambda self: self._m.config()["embed_dim"])
    num_heads = property(lambda self: self._m.config()["num_heads"])
    num_kv_heads = property(lambda self: self._m.config()["num_kv_heads"])
    head_dim = property(lambda self: self._m.config()["head_dim"])
    kdim = property(lambda self: self._m.config()["kdim"])
    vdim = property(lambda self: self._m.config()["vdim"])
    dropout = property(lambda self: self._m.config()["dropout"])
    batch_first = property(lambda self: self._m.config()["batch_first"])

    def __repr__(self) -> str:
        c = self.config
        return (f"mha.MultiheadAttention(embed_dim={c['embed_dim']}, num_heads={c['num_heads']}, "
                f"num_kv_heads={c['num_kv_heads']}, batch_first={c['batch_first']})")

    def train(self, mode: bool = True) -> "MultiheadAttention":
        """Training mode (dropout active when > 0). Returns self, like torch."""
        self.training = bool(mode)
        return self

    def eval(self) -> "MultiheadAttention":
        """Inference mode (no dropout). Returns self."""
        return self.train(False)

    def release_workspace(self) -> None:
        """Frees the working buffers (projections, attention heads, a training step's gradient rows)
        the module keeps between calls to reuse them; the next call allocates afresh."""
        self._m.release_workspace()

    def parameter_count(self) -> int:
        """Number of trainable scalars (4·E² + 4·E for a plain module with bias)."""
        return self._m.parameter_count()

    # ---- parameters under PyTorch's names -----------------------------------------------------
    def state_dict(self) -> Dict[str, np.ndarray]:
        """Parameters as numpy arrays (copies) under torch.nn.MultiheadAttention's names, in its order:
        in_proj_weight or q/k/v_proj_weight, in_proj_bias, bias_k, bias_v, out_proj.weight, out_proj.bias."""
        return {n: self._m.get(n) for n in self._m.param_names()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Loads parameters by PyTorch name (numpy arrays, or CPU torch tensors). Shapes must match;
        with ``strict`` every parameter must be present and no other name may appear; ``sinks``
        must be finite (ValueError naming it, the module unchanged)."""
        names = self._m.param_names()
        if strict:
            missing = [n for n in names if n not in state_dict]
            unexpected = [n for n in state_dict if n not in names]
            if missing or unexpected:
                raise ValueError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        # All or nothing: every tensor is converted and checked on a copy of the module first, so a
        # bad one late in the dict leaves the module as it was (as mha::io::load_weights does).
        staged = copy.copy(self._m)
        for n, value in state_dict.items():
            if n in names:
                staged.set(n, _f32(n, value, "load_state_dict"))
        _finite_sinks("load_state_dict", staged)
        self._m = staged

    def save(self, path: PathLike, names: str = "pytorch") -> None:
        """Writes the parameters and configuration to a safetensors file, under PyTorch names
        (``names="pytorch"``) or Hugging Face ones (``"huggingface"``: q_proj, k_proj, v_proj, o_proj)."""
        self._m.save(os.fspath(path), names)

    @classmethod
    def load(cls, path: PathLike) -> "MultiheadAttention":
        """A module built from a safetensors file's configuration metadata and weights (either naming)."""
        core = _core.load_module(os.fspath(path))
        _finite_sinks("MultiheadAttention.load", core)
        return cls._wrap(core)

    def load_weights(self, path: PathLike) -> None:
        """Loads weights (either naming) from a safetensors file into this module. Shapes are checked,
        and every configuration field the file's metadata states (mha's own files state them all)
        must be this module's, but batch_first and dropout: ValueError naming the field otherwise
        (or naming ``sinks``, which must be finite)."""
        # Into a copy, then swapped in (as load_state_dict): a forward running on another thread
        # (without the GIL) keeps reading the parameters it started with, never freed ones.
        staged = copy.copy(self._m)
        _core.load_weights(staged, os.fspath(path))
        _finite_sinks("load_weights", staged)
        self._m = staged

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, query: Any, key: Any, value: Any, key_padding_mask: Any = None, need_weights: bool = True,
                attn_mask: Any = None, average_attn_weights: bool = True, is_causal: bool = False,
                *, threads: int = 0, need_lse: bool = False, cu_seqlens_q: Any = None,
                cu_seqlens_k: Any = None) -> Tuple[np.ndarray, ...]:
        """torch.nn.MultiheadAttention.forward, on numpy arrays.

        Masks use PyTorch's polarity at this boundary: a boolean ``attn_mask`` ((T_q, T_k) or
        (B·h, T_q, T_k)) is True where attention is NOT allowed; a float one is added to the scores.
        A boolean ``key_padding_mask`` ((B, T_k), or (T_k) unbatched) is True at padding; a float
        one is added. ``is_causal=True`` applies the top-left causal mask (query i sees keys ≤ i),
        together with any attn_mask. Returns ``(output, weights)``: weights are (B, T_q, S) averaged
        over heads, (B, h, T_q, S) with ``average_attn_weights=False``, None when not ``need_weights``.

        ``need_lse=True`` returns ``(output, weights, lse)``: each row's log-sum-exp of the scaled,
        edited, masked scores, (B, h, T_q) or (h, T_q) unbatched (−inf for a fully masked row).

        Packed variable-length batch (C++ MhaForwardOptions::packed): ``cu_seqlens_q`` (B + 1
        offsets) with 2-D query (total_q, E), key/value (total_k, ·); ``cu_seqlens_k`` defaults to
        ``cu_seqlens_q``. No token attends another sequence; ``is_causal`` is per sequence (top
        left). Not with masks, weights or dropout: pass ``need_weights=False``.
        """
        fn = "MultiheadAttention.forward"
        q, k, v = _f32("query", query, fn), _f32("key", key, fn), _f32("value", value, fn)
        need = "none" if not need_weights else ("averaged" if average_attn_weights else "per_head")
        training = self.training and self.dropout > 0.0
        args = _forward_args(fn, key_padding_mask, attn_mask, is_causal, need, training, self.dropout_seed, threads)
        if cu_seqlens_k is not None and cu_seqlens_q is None:
            raise ValueError(f"{fn}: cu_seqlens_k needs cu_seqlens_q (a packed batch)")
        if cu_seqlens_q is not None:
            args.cu_seqlens_q = [int(x) for x in _offsets("cu_seqlens_q", cu_seqlens_q, fn)]
            if cu_seqlens_k is not None:
                args.cu_seqlens_k = [int(x) for x in _offsets("cu_seqlens_k", cu_seqlens_k, fn)]
        args.need_lse = bool(need_lse)
        if training:
            # A fresh dropout mask per call, reproducible from the module's seed (mod 2**64, its range).
            self.dropout_seed = (self.dropout_seed + 1) % 2**64
        out, weights, lse = self._m.forward(q, k, v, args)
        return (out, weights, lse) if need_lse else (out, weights)

    __call__ = forward

    # ---- decoding with a KV cache -------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int, *, dtype: str = "f32", ring: bool = False,
                  sinks: int = 0, int8_keys: str = "per-token", key_group: int = 32,
                  key_layout: str = "rows") -> KvCache:
        """A KV cache sized for this module: ``batch`` sequences of up to ``capacity`` positions
        (``sinks``, ``int8_keys``, ``key_group``, ``key_layout``: see :class:`KvCache`)."""
        c = self.config
        return KvCache(batch, c["num_kv_heads"], c["head_dim"], capacity, dtype=dtype, ring=ring, sinks=sinks,
                       int8_keys=int8_keys, key_group=key_group, key_layout=key_layout)

    def new_paged_cache(self, num_blocks: int, block_size: int = 16, *, dtype: str = "f32",
                        key_layout: str = "rows") -> PagedKvCache:
        """A paged KV cache sized for this module: a pool of ``num_blocks`` blocks of ``block_size``
        positions shared by every sequence added to it (``key_layout``: see :class:`PagedKvCache`)."""
        c = self.config
        return PagedKvCache(c["num_kv_heads"], c["head_dim"], block_size, num_blocks=num_blocks, dtype=dtype,
                            key_layout=key_layout)

    def forward_incremental(self, query: Any, key: Any, value: Any, cache: Union[KvCache, PagedKvCache], *,
                            seqs: Optional[Sequence[int]] = None, new_lengths: Optional[Sequence[int]] = None,
                            window: int = 0, threads: int = 0) -> np.ndarray:
        """Decodes new tokens against ``cache`` and appends their K/V to it.

        query/key/value hold T_new new tokens per sequence in forward()'s layout (1 to decode, many to
        prefill). Each new token attends causally, by absolute position, to the cache plus the new
        tokens. ``new_lengths`` (B entries) lets sequence b take only its first tokens (right padding).
        Prefill followed by one-token steps equals ``forward(…, is_causal=True)`` row for row.
        With a :class:`PagedKvCache`, batch row b reads and extends sequence ``seqs[b]`` (distinct
        live ids); the result equals the contiguous cache's bitwise. Decoding is inference: no
        dropout, whatever the module's training mode.
        Returns the output only (no weights)."""
        fn = "MultiheadAttention.forward_incremental"
        q, k, v = _f32("query", query, fn), _f32("key", key, fn), _f32("value", value, fn)
        lens = _i64_list(fn, "new_lengths", new_lengths)
        if isinstance(cache, PagedKvCache):
            if seqs is None:
                raise ValueError(f"{fn}: a PagedKvCache needs seqs=[…], one sequence id per batch row")
            ids = _i64_list(fn, "seqs", seqs)
            return self._m.forward_incremental_paged(q, k, v, cache._c, ids, lens, _i64(fn, "window", window),
                                                     _threads(fn, threads))
        if not isinstance(cache, KvCache):
            raise TypeError(f"{fn}: cache must be an mha.KvCache or mha.PagedKvCache, got {type(cache).__name__}")
        if seqs is not None:
            raise ValueError(f"{fn}: seqs= is for a PagedKvCache; a KvCache's batch row b is sequence b")
        return self._m.forward_incremental(q, k, v, cache._c, lens, _i64(fn, "window", window),
                                           _threads(fn, threads))


def prune_heads(module: MultiheadAttention, heads: Sequence[int], *, duplicate_kv: bool = False) -> MultiheadAttention:
    """A smaller module without ``heads`` (original indices), equal to the original with those heads'
    contributions zeroed. Grouped-query groups left uneven are refused (ValueError) unless
    ``duplicate_kv=True`` (which splits groups by duplicating K/V heads)."""
    if not isinstance(module, MultiheadAttention):
        raise TypeError(f"prune_heads: module must be an mha.MultiheadAttention, got {type(module).__name__}")
    # Each index checked, not int()-converted: 1.7, True and "2" were taken as heads 1, 1 and 2.
    hs = [_i64("prune_heads", "heads[]", h) for h in heads]
    return MultiheadAttention._wrap(module._m.prune(hs, bool(duplicate_kv)))


def head_importance(module: MultiheadAttention, query: Any, key: Any, value: Any, *, key_padding_mask: Any = None,
                    attn_mask: Any = None, is_causal: bool = False) -> np.ndarray:
    """Each head's importance by ablation: ‖y − y₋ᵢ‖ / ‖y‖ on these inputs (masks in PyTorch's polarity)."""
    fn = "head_importance"
    if not isinstance(module, MultiheadAttention):
        raise TypeError(f"{fn}: module must be an mha.MultiheadAttention, got {type(module).__name__}")
    q, k, v = _f32("query", query, fn), _f32("key", key, fn), _f32("value", value, fn)
    args = _forward_args(fn, key_padding_mask, attn_mask, is_causal, "none", False, 0, 0)
    return np.asarray(module._m.head_importance(q, k, v, args))


def analyze(weights: Any, *, query_offset: Optional[int] = None, key_positions: Optional[int] = None,
            key_padding_mask: Any = None, query_padding_mask: Any = None,
            png: Optional[PathLike] = None) -> List[Dict[str, Any]]:
    """What each head does, from attention weights (B, h, T_q, T_k) or (h, T_q, T_k).

    Returns one dict per head: ``head``, ``rows`` (rows measured), ``entropy`` (nats), ``sink``
    (mass on key 0), ``prev_token``, ``self``, ``focus`` and ``class`` (``"attention_sink"``,
    ``"prev_token"``, ``"self_attend"``, ``"focused"``, ``"broad"`` or ``"empty"``). With ``png``,
    also writes a heat map of the first sequence's heads there.

    Query i's own key is ``i + query_offset`` (default: bottom-right, ``key_positions - T_q``; a
    top-left causal mask's is 0). ``key_positions`` (default T_k) says how many leading key columns
    are sequence positions: pass T_k - 1 (- 2) for weights of a module with ``add_bias_kv`` (and
    ``add_zero_attn``), whose extra columns come last and are never a query's own or previous token.
    Rows with no weight on any of the first ``key_positions`` columns are not measured: fully masked
    rows, and rows whose masks left them only the extra columns (which would read as focus 1,
    entropy 0). A hidden key's weight is exactly 0; the weights decide, as in ``head_metrics``.

    Padding, boolean, True = padding (torch's key_padding_mask polarity): ``key_padding_mask``
    (B, key_positions) makes each sequence's sink its first real key; ``query_padding_mask`` (B, T_q)
    leaves those rows out of every mean (for self-attention, pass the key padding mask as both).
    """
    fn = "analyze"
    w = _f32("weights", weights, fn)

    def padding(name: str, m: Any) -> Optional[np.ndarray]:
        if m is None:
            return None
        a = np.asarray(m)
        if a.dtype != np.bool_:
            raise TypeError(f"{fn}: {name} must be a boolean array (True = padding), got dtype {a.dtype}")
        return a  # read in place by the binding, whatever its strides

    result = _core.analyze(w, None if query_offset is None else _i64(fn, "query_offset", query_offset),
                           None if key_positions is None else _i64(fn, "key_positions", key_positions),
                           padding("key_padding_mask", key_padding_mask),
                           padding("query_padding_mask", query_padding_mask))
    if png is not None:
        if w.ndim == 4 and w.shape[0] == 0:
            raise ValueError(f"analyze: weights {tuple(w.shape)} hold no sequence: nothing to draw")
        _core.write_heatmap_png(os.fspath(png), w[0] if w.ndim == 4 else w)
    return result


def load_safetensors(path: PathLike) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Reads every tensor of a safetensors file as numpy (float types → float32, BOOL → bool,
    integer types as they are: U8 → uint8, I64 → int64, …), with the file's metadata. The file is
    validated completely first (mha/safetensors.h); a finite F64 value past float32's range is a
    ValueError naming the tensor."""
    return _core.read_safetensors(os.fspath(path))


def _gradients(self: MultiheadAttention, query: Any, key: Any, value: Any, d_output: Any,
               key_padding_mask: Any = None, attn_mask: Any = None, is_causal: bool = False,
               *, threads: int = 0) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
    """Forward and backward in one call: returns ``(output, grads)`` where ``grads`` maps ``"query"``,
    ``"key"``, ``"value"`` (per argument, even for self-attention: sum them yourself) and every
    parameter's PyTorch name to ∂L/∂(that), for L = sum(output · d_output). Masks as in :meth:`forward`;
    dropout applies in training mode with the module's dropout seed."""
    fn = "MultiheadAttention.gradients"
    q, k, v = _f32("query", query, fn), _f32("key", key, fn), _f32("value", value, fn)
    training = self.training and self.dropout > 0.0
    args = _forward_args(fn, key_padding_mask, attn_mask, is_causal, "none", training, self.dropout_seed, threads)
    output, ctx = self._m.forward_train(q, k, v, args)
    grads = self._m.backward(ctx, _f32("d_output", d_output, fn))
    return output, grads


MultiheadAttention.gradients = _gradients
