"""Scaled dot-product attention on numpy arrays: :func:`sdpa` and :func:`sdpa_backward`."""
from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core

__all__ = ["Causal", "Allowed", "Additive", "sdpa", "sdpa_backward"]


@dataclass(frozen=True)
class Causal:
    """Which keys a causal mask lets query ``q`` see: key ``k`` is visible when ``k <= q + offset``.

    Build one by meaning, never by a bare flag:

    * ``Causal.top_left()``: offset 0, PyTorch's ``is_causal`` (query 0 sees key 0 only).
    * ``Causal.bottom_right()``: offset ``T_k - T_q``, the last query sees every key
      (FlashAttention's convention; KV-cache decoding).
    * ``Causal.offset(n)``: an explicit offset, e.g. the absolute position of query 0.
    """

    align: str = "none"
    value: int = 0

    def __post_init__(self) -> None:
        if self.align not in ("none", "top_left", "bottom_right", "offset"):
            raise ValueError(f"Causal: align must be 'none', 'top_left', 'bottom_right' or 'offset', got {self.align!r}")
        object.__setattr__(self, "value", _i64("Causal", "value", self.value))

    @staticmethod
    def none() -> "Causal":
        """No causal mask."""
        return Causal("none", 0)

    @staticmethod
    def top_left() -> "Causal":
        """Offset 0: query ``i`` sees keys ``0 … i`` (PyTorch's ``is_causal=True``)."""
        return Causal("top_left", 0)

    @staticmethod
    def bottom_right() -> "Causal":
        """Offset ``T_k - T_q``: the last query sees every key."""
        return Causal("bottom_right", 0)

    @staticmethod
    def offset(n: int) -> "Causal":
        """Query ``i`` sees keys ``0 … i + n``."""
        return Causal("offset", _i64("Causal.offset", "n", n))


class Allowed:
    """An attention mask whose True entries MAY be attended (mha's polarity).

    Wrap a boolean array, broadcastable to (B, h, T_q, T_k), to pass it as ``attn_mask``.
    """

    def __init__(self, mask: Any):
        self.mask = mask

    def __repr__(self) -> str:
        return f"mha.Allowed(shape={np.shape(self.mask)})"


class Additive:
    """A float bias added to the scaled scores (−inf masks a position out).

    Wrap a float array, broadcastable to (B, h, T_q, T_k), to pass it as ``attn_mask``.
    """

    def __init__(self, bias: Any):
        self.bias = bias

    def __repr__(self) -> str:
        return f"mha.Additive(shape={np.shape(self.bias)})"


# ---- argument conversion ---------------------------------------------------------------------

def _narrowed(name: str, a: np.ndarray, fn: str) -> np.ndarray:
    """a (real numbers of another dtype) as float32. A finite value the cast would make ±inf (past
    float32's range: 3.4e38) is a ValueError naming the argument and its index, as the safetensors
    reader refuses such an F64 value: converted silently, it came back as an inf or NaN output."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = a.astype(np.float32)
    if a.dtype.kind == "f" and a.dtype.itemsize > 4:
        past = np.isinf(f) & np.isfinite(a)
        if past.any():
            at = tuple(int(i) for i in np.unravel_index(int(np.argmax(past)), a.shape))
            raise ValueError(f"{fn}: {name}{list(at)} = {a[at]!r} is finite but beyond float32's range, which mha "
                             "computes in")
    return f


def _float_array(name: str, x: Any, fn: str) -> np.ndarray:
    """float32 ndarray; other real float dtypes are converted (a copy, _narrowed); anything else is a
    TypeError."""
    if x is None:
        raise TypeError(f"{fn}: {name} must be an array, got None")
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype == np.float32:
        return a
    if a.dtype.kind == "f" or a.dtype.kind in "iu" and not isinstance(x, np.ndarray):
        return _narrowed(name, a, fn)
    raise TypeError(f"{fn}: {name} must be a float32 array (float16/float64 are converted), got dtype {a.dtype}")


def _in_place(a: np.ndarray) -> np.ndarray:
    """The array itself when the kernels can read it through a strided view (non-negative strides
    that are whole elements), else a C-contiguous copy."""
    if all(s >= 0 and s % a.itemsize == 0 for s in a.strides):
        return a
    return np.ascontiguousarray(a)


def _rank4(name: str, a: np.ndarray, fn: str) -> np.ndarray:
    if a.ndim != 4:
        raise ValueError(f"{fn}: {name} must be 4-D (B, heads, T, d), got shape {a.shape}")
    return a


def _broadcast4(name: str, a: np.ndarray, fn: str) -> np.ndarray:
    """A mask of rank ≤ 4 as 4-D with leading 1s (numpy broadcasting), without copying."""
    if a.ndim > 4:
        raise ValueError(f"{fn}: {name} must have at most 4 dimensions, got shape {a.shape}")
    return a.reshape((1,) * (4 - a.ndim) + a.shape)


def _bool_mask(name: str, m: Any, fn: str) -> np.ndarray:
    a = np.asarray(m)
    if a.dtype != np.bool_:
        raise TypeError(f"{fn}: {name} must be a boolean array, got dtype {a.dtype}")
    return _in_place(_broadcast4(name, a, fn)).view(np.uint8)


def _float_mask(name: str, m: Any, fn: str) -> np.ndarray:
    return _in_place(_broadcast4(name, _float_array(name, m, fn), fn))


# The smallest magnitude that rounds to ±inf in float32: FLT_MAX plus half its last step.
_FLOAT32_OVERFLOW = 3.4028235677973366e38


def _finite(fn: str, name: str, values: Sequence[float]) -> None:
    """A ValueError naming the argument and its first NaN or ±inf entry, or one that float32 (which
    the library holds them in) rounds to ±inf, if any. The library refuses them too, but its message
    names its own field and check ("MhaConfig: alibi slope nan", "sdpa: sink logit 1"), neither of
    which the Python caller wrote."""
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise ValueError(f"{fn}: {name} must be finite, got {name}[{i}] = {v}")
        if abs(v) >= _FLOAT32_OVERFLOW:
            raise ValueError(f"{fn}: {name}[{i}] = {v} is finite but beyond float32's range")


def _per_head(name: str, x: Any, fn: str) -> List[float]:
    """One finite number per head (ALiBi slopes, sink logits) as a list of floats: TypeError for
    anything but a 1-D array of numbers, ValueError (:func:`_finite`) for a NaN or ±inf."""
    a = np.asarray(x)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.number) or a.ndim != 1:
        raise TypeError(f"{fn}: {name} must be a 1-D sequence of numbers (one per query head), got "
                        f"{a.dtype} with shape {a.shape}")
    values = [float(v) for v in a]
    _finite(fn, name, values)
    return values


def _score_edit_values(fn: str, alibi_slopes: Any, softcap: Any, sinks: Any) -> Tuple[List[float], float, List[float]]:
    """(ALiBi slopes, softcap, sink logits) as the core takes them, an empty list for None (off);
    types and finiteness are checked here (:func:`_per_head`), lengths and the softcap's value by the
    library (ValueError naming the argument)."""
    slopes = [] if alibi_slopes is None else _per_head("alibi_slopes", alibi_slopes, fn)
    return slopes, _number(fn, "softcap", softcap), [] if sinks is None else _per_head("sinks", sinks, fn)


def _score_edits(fn: str, args: "_core.SdpaArgs", alibi_slopes: Any, softcap: Any, sinks: Any) -> None:
    """ALiBi slopes, softcap and sinks onto ``args`` (:func:`_score_edit_values`)."""
    args.alibi_slopes, args.softcap, args.sinks = _score_edit_values(fn, alibi_slopes, softcap, sinks)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The standard ALiBi slopes for ``num_heads`` heads (Press et al.; BLOOM's recipe when
    ``num_heads`` is not a power of two), float32."""
    return np.asarray(_core.alibi_slopes(_i64("alibi_slopes", "num_heads", num_heads)), dtype=np.float32)


def _args(fn: str, scale, attn_mask, allowed, bias, key_padding_mask, causal, window, dropout_p, seed,
          threads) -> "_core.SdpaArgs":
    a = _core.SdpaArgs()
    bias_name = "bias"
    if scale is not None:
        a.scale = _number(fn, "scale", scale)
    if attn_mask is not None:
        if isinstance(attn_mask, Allowed):
            if allowed is not None:
                raise ValueError(f"{fn}: pass the allowed mask once (attn_mask=Allowed(…) or allowed=…)")
            allowed = attn_mask.mask
        elif isinstance(attn_mask, Additive):
            if bias is not None:
                raise ValueError(f"{fn}: pass the additive mask once (attn_mask=Additive(…) or bias=…)")
            bias = attn_mask.bias
        else:
            arr = np.asarray(attn_mask)
            if arr.dtype == np.bool_:
                raise TypeError(f"{fn}: a bare boolean attn_mask is ambiguous; pass allowed=… (True = may attend) "
                                f"or attn_mask=mha.Allowed(…) (PyTorch's 'True = masked out' is ~allowed)")
            if bias is not None:
                raise ValueError(f"{fn}: pass the additive mask once (attn_mask or bias)")
            bias, bias_name = arr, "attn_mask"
    if allowed is not None:
        a.allowed = _bool_mask("allowed", allowed, fn)
    if bias is not None:
        a.bias = _float_mask(bias_name, bias, fn)
    if key_padding_mask is not None:
        kpm = np.asarray(key_padding_mask)
        if kpm.ndim != 2:
            raise ValueError(f"{fn}: key_padding_mask must be (B, T_k), got shape {kpm.shape}")
        kpm4 = kpm.reshape(kpm.shape[0], 1, 1, kpm.shape[1])
        if kpm.dtype == np.bool_:
            a.key_padding = _in_place(kpm4).view(np.uint8)
        elif kpm.dtype.kind != "f":
            raise TypeError(f"{fn}: key_padding_mask must be bool (True = padding) or float (added to the scores), "
                            f"got {kpm.dtype}")
        else:
            # Converted (and range-checked) as the (B, T_k) array the caller passed, so that an
            # error names its index there, not in the 4-D view.
            kpm = _float_array("key_padding_mask", kpm, fn)
            a.key_bias = _in_place(kpm.reshape(kpm.shape[0], 1, 1, kpm.shape[1]))
    if causal is not None:
        if not isinstance(causal, Causal):
            raise TypeError(f"{fn}: causal must be an mha.Causal (Causal.top_left(), .bottom_right(), .offset(n)) "
                            f"or None, got {type(causal).__name__}")
        a.causal = causal.align
        a.causal_offset = causal.value
    window = _i64(fn, "window", window)
    if window < 0:
        raise ValueError(f"{fn}: window must be >= 0, got {window}")
    if window and (causal is None or causal.align == "none"):
        raise ValueError(f"{fn}: window={window} needs a causal alignment (e.g. causal=mha.Causal.bottom_right())")
    a.window = window
    a.dropout_p = _probability(fn, "dropout_p", _number(fn, "dropout_p", dropout_p))
    a.seed = _seed(fn, "seed", seed)
    if threads is not None:
        a.threads = _threads(fn, threads)
    return a


def _bf16(a: np.ndarray) -> np.ndarray:
    return _core.to_bf16_bits(a)


def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: Optional[float] = None,
         attn_mask: Union[None, Allowed, Additive, np.ndarray] = None, allowed: Optional[np.ndarray] = None,
         bias: Optional[np.ndarray] = None, key_padding_mask: Optional[np.ndarray] = None,
         causal: Optional[Causal] = None, window: int = 0, dropout_p: float = 0.0, seed: int = 0,
         return_weights: bool = False, return_lse: bool = False, threads: Optional[int] = None,
         dtype: str = "f32", alibi_slopes: Optional[Any] = None, softcap: float = 0.0,
         sinks: Optional[Any] = None) -> Union[np.ndarray, Tuple[np.ndarray, ...]]:
    """Scaled dot-product attention: ``softmax(scale · q kᵀ + masks) v`` per head.

    Args:
        q: (B, h, T_q, d) queries. k: (B, kv, T_k, d) keys. v: (B, kv, T_k, d_v) values.
            ``h`` must be a multiple of ``kv``; query head ``i`` reads K/V head ``i // (h // kv)``
            (grouped-query / multi-query attention, K/V never repeated).
        scale: multiplies the scores; default ``1/sqrt(d)``.
        attn_mask: ``mha.Allowed(bool_array)`` (True = may attend), ``mha.Additive(float_array)``, or a
            float array (additive). A bare boolean array is refused (TypeError): its polarity is
            ambiguous. Broadcastable to (B, h, T_q, T_k) (each extent full or 1; fewer dims get leading 1s).
        allowed: boolean mask, True = may attend (same as ``attn_mask=mha.Allowed(…)``).
        bias: float mask added after scaling; −inf masks out (same as ``attn_mask=mha.Additive(…)``).
        key_padding_mask: (B, T_k). Boolean: True = padding (the key is never read).
            Float: added to every query's score for that key.
        causal: ``mha.Causal.top_left()``, ``.bottom_right()`` or ``.offset(n)``; None = not causal.
        window: sliding window (needs ``causal``): key visible only if ``pos − window < key <= pos``.
        dropout_p, seed: dropout on the probabilities (counter-based generator; same seed, same mask).
        return_weights: also return the (B, h, T_q, T_k) probabilities.
        return_lse: also return the (B, h, T_q) log-sum-exp of each score row (−inf when fully masked).
        threads: worker threads for this call; None = the library default (:func:`mha.set_num_threads`).
        dtype: ``"f32"`` (default) or ``"bf16"``: q/k/v are rounded to bfloat16 on entry (a copy;
            numpy has no bfloat16), products accumulate in float32; outputs are float32.
        alibi_slopes: ALiBi, one slope per query head (``mha.alibi_slopes(h)`` is the standard
            schedule): adds ``−m_h·(q_pos − k_pos)`` to the scores, positions aligned like ``causal``
            (bottom-right without it). Computed in the kernel, no (T_q, T_k) tensor.
        softcap: ``c > 0`` caps the scaled scores, ``s → c·tanh(s/c)``, before masks/ALiBi (Gemma 2);
            0 = off.
        sinks: one learned sink logit per query head (gpt-oss): joins each row's softmax
            denominator without a value; the returned lse includes it, and a fully masked row
            gives zeros with lse = the sink.

    Returns:
        ``out`` (B, h, T_q, d_v) float32, or a tuple ``(out, weights?, lse?)`` with the requested extras.

    Memory: float32 inputs are read in place through strided views, never copied, when their strides
    are non-negative (C-contiguous arrays, slices, transposes such as ``x.transpose(0, 2, 1, 3)``,
    ``np.broadcast_to`` views). Arrays with negative strides, and non-float32 inputs, are copied first.
    Outputs are fresh arrays written directly by the kernels. The GIL is released while computing.

    Raises:
        TypeError: wrong argument types or dtypes. ValueError: shapes or values the library rejects
        (its message names the argument and the shapes).
    """
    fn = "sdpa"
    if dtype not in ("f32", "bf16"):
        raise ValueError(f"sdpa: dtype must be 'f32' or 'bf16', got {dtype!r}")
    qa, ka, va = (_in_place(_rank4(n, _float_array(n, x, fn), fn)) for n, x in (("q", q), ("k", k), ("v", v)))
    if dtype == "bf16":
        qa, ka, va = _bf16(qa), _bf16(ka), _bf16(va)
    args = _args(fn, scale, attn_mask, allowed, bias, key_padding_mask, causal, window, dropout_p, seed, threads)
    _score_edits(fn, args, alibi_slopes, softcap, sinks)
    out, weights, lse = _core.sdpa(qa, ka, va, args, bool(return_weights), bool(return_lse), dtype == "bf16")
    if not return_weights and not return_lse:
        return out
    result = [out]
    if return_weights:
        result.append(weights)
    if return_lse:
        result.append(lse)
    return tuple(result)


def _kind(value: Any) -> str:
    """numpy's kind letter of an array, numpy scalar or torch tensor's dtype ("i", "u", "f", "b",
    "c", "U", "O", …); "i" for what has no dtype (Python numbers: isinstance tells those apart)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return "i"
    if isinstance(dtype, np.dtype):
        return dtype.kind
    text = str(dtype)  # torch: "torch.float32", "torch.int64", "torch.bool", "torch.complex64"
    if "bool" in text:
        return "b"
    if "complex" in text:
        return "c"
    return "u" if "uint" in text else "f" if "float" in text or "half" in text else "i"


def _integer(fn: str, name: str, value: Any) -> int:
    """``value`` as a Python int if it is an integer (operator.index: int, numpy integers and 0-d
    integer arrays, torch integer scalars); a TypeError naming the argument for a bool and for
    anything int() would truncate or parse (2.5, "3")."""
    if isinstance(value, (bool, np.bool_)) or _kind(value) not in "iu":
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}") from None


def _i64(fn: str, name: str, value: Any) -> int:
    """``value`` as a Python int for a 64-bit C++ argument: a TypeError or ValueError naming the
    argument, where pybind11 would raise a TypeError that prints every argument of the call (whole
    arrays included)."""
    v = _integer(fn, name, value)
    if not -2**63 <= v < 2**63:
        raise ValueError(f"{fn}: {name} must fit in 64 bits, got {v}")
    return v


def _optional_count(fn: str, name: str, value: Any, default: str) -> int:
    """An optional width or head count (kdim, vdim, num_kv_heads) for the core, which reads 0 as "the
    default": None gives 0, anything else must be at least 1 (an explicit 0 would otherwise turn
    silently into the default; torch builds (E, 0) projections for kdim=0, which mha refuses)."""
    if value is None:
        return 0
    v = _i64(fn, name, value)
    if v < 1:
        raise ValueError(f"{fn}: {name} must be at least 1 (or None for {default}), got {v}")
    return v


def _number(fn: str, name: str, value: Any) -> float:
    """``value`` as a Python float for a C++ float argument: a TypeError naming the argument for
    anything but a real number (a string such as "0.1" included, which float() would take)."""
    # Anything with a real value (int, float, Decimal, Fraction, numpy scalars and 0-d arrays,
    # torch scalars), but no bool, no string (float("0.1") would parse it), no complex (numpy's
    # float() drops the imaginary part) and no array of several numbers.
    if getattr(value, "ndim", 0) != 0:
        raise TypeError(f"{fn}: {name} must be a single number, got {type(value).__name__} of shape "
                        f"{tuple(getattr(value, 'shape', ()))}")
    if isinstance(value, (bool, np.bool_, str, bytes)) or _kind(value) not in "iuf" or not hasattr(value, "__float__"):
        raise TypeError(f"{fn}: {name} must be a number, got {type(value).__name__}")
    return float(value)


def _probability(fn: str, name: str, p: float) -> float:
    """A dropout probability in [0, 1) that stays below 1 as the float32 the library takes: a value
    within 3e-8 of 1 rounds to 1.0f, and the library's own check would then say "got 1"."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{fn}: {name} must be in [0, 1), got {p}")
    if np.float32(p) >= 1.0:
        below = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
        raise ValueError(f"{fn}: {name} = {p!r} rounds to 1 in float32 (the library's type): at most {below!r}")
    return float(p)


def _name(fn: str, name: str, value: Any) -> str:
    """``value`` as a Python str for a C++ string argument (a dtype, a layout): a TypeError naming
    the argument otherwise; the library checks the spelling."""
    if not isinstance(value, str):
        raise TypeError(f"{fn}: {name} must be a str, got {type(value).__name__}")
    return value


@contextlib.contextmanager
def _named_errors(fn: str, heads: Tuple[str, ...]) -> Iterator[None]:
    """Names what the user called in the core's ValueErrors whose message starts with one of
    ``heads``: names a Python caller never wrote, such as the C++ configuration "MhaConfig" or the
    module's own "MultiheadAttention.forward" behind mha.torch."""
    try:
        yield
    except ValueError as e:
        head, sep, rest = str(e).partition(": ")
        if sep and head in heads:
            raise ValueError(f"{fn}: {rest}") from None
        raise


def _count(fn: str, name: str, value: Any, zero: str) -> int:
    """A count the core takes as a C int: an int ≥ 0 (``zero`` says what 0 means), as :func:`_i64`
    says; counts past a C int are capped, as the library caps every count to the work there is."""
    v = _i64(fn, name, value)
    if v < 0:
        raise ValueError(f"{fn}: {name} must be >= 0 (0 = {zero}), got {v}")
    return min(v, 2**31 - 1)


def _threads(fn: str, threads: Any) -> int:
    """A per-call thread count (0 = the library default): :func:`_count`."""
    return _count(fn, "threads", threads, "the library default")


def _splits(fn: str, splits: Any) -> int:
    """A decode split count (0 = chosen from the shapes): :func:`_count`."""
    return _count(fn, "splits", splits, "auto")


def set_num_threads(threads: int) -> None:
    """The default thread count of every later call that passes threads=0 (0: OpenMP's default,
    which is OMP_NUM_THREADS where set, else the CPUs the process may run on)."""
    _core.set_num_threads(_threads("set_num_threads", threads))


def set_tensor_cache_limit(bytes: int) -> None:  # noqa: A002 (the library's own name for it)
    """Sets the tensor cache's limit in bytes, freeing the oldest blocks beyond it (0 turns it off)."""
    fn = "set_tensor_cache_limit"
    v = _i64(fn, "bytes", bytes)
    if v < 0:
        raise ValueError(f"{fn}: bytes must be >= 0 (0 = off), got {v}")
    _core.set_tensor_cache_limit(v)


def _seed(fn: str, name: str, value: Any) -> int:
    """A seed (dropout's, or a module's initialisation): an int in [0, 2**64), as :func:`_i64` names
    a wrong type (TypeError) or value (ValueError)."""
    v = _integer(fn, name, value)
    if not 0 <= v < 2**64:
        raise ValueError(f"{fn}: {name} must be in [0, 2**64), got {v}")
    return v


def _offsets(name: str, x: Any, fn: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise TypeError(f"{fn}: {name} must be a 1-D integer array of B + 1 offsets, got dtype {a.dtype}, "
                        f"shape {a.shape}")
    return a.astype(np.int64)


def sdpa_varlen(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, *,
                max_seqlen_q: int = 0, max_seqlen_k: int = 0, scale: Optional[float] = None,
                causal: Optional[Causal] = None, window: int = 0, return_lse: bool = False,
                threads: Optional[int] = None, dtype: str = "f32", alibi_slopes: Optional[Any] = None,
                softcap: float = 0.0, sinks: Optional[Any] = None) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """Attention over a packed batch of variable-length sequences (FlashAttention's varlen).

    Args:
        q: (total_q, h, d), k: (total_k, kv, d), v: (total_k, kv, d_v): the sequences back to back,
            no padding. Sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key rows
            ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``; no token attends another sequence.
        cu_seqlens_q, cu_seqlens_k: B + 1 non-decreasing offsets from 0 to the totals (int32 or int64).
        max_seqlen_q, max_seqlen_k: when > 0, checked as upper bounds of every length.
        causal: ``mha.Causal.top_left()`` / ``.bottom_right()`` / ``.offset(n)``, aligned per sequence.
        window, scale, threads, dtype: as :func:`sdpa`. Only causal masking; no dropout, no weights.
        alibi_slopes, softcap, sinks: as :func:`sdpa`, applied to each sequence as if it ran alone:
            ALiBi's positions follow the sequence's own causal alignment (bottom-right by its own
            lengths without ``causal``), and each row's sink joins its denominator (and its lse).

    Returns:
        ``out`` (total_q, h, d_v), or ``(out, lse)`` with lse (total_q, h) when ``return_lse``.
        float32 inputs are read in place (no copy) when their strides allow it. Each sequence's
        rows are bitwise those of :func:`sdpa` on that sequence alone with the same arguments.
    """
    fn = "sdpa_varlen"
    if dtype not in ("f32", "bf16"):
        raise ValueError(f"{fn}: dtype must be 'f32' or 'bf16', got {dtype!r}")
    arrays = []
    for n, x in (("q", q), ("k", k), ("v", v)):
        a = _float_array(n, x, fn)
        if a.ndim != 3:
            raise ValueError(f"{fn}: {n} must be 3-D (total, heads, d), got shape {a.shape}")
        if dtype == "bf16":
            a = _bf16(a)
        arrays.append(_in_place(a[None].transpose(0, 2, 1, 3)))  # (1, heads, total, d), a view
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, fn)
    cu_k = _offsets("cu_seqlens_k", cu_seqlens_k, fn)
    args = _args(fn, scale, None, None, None, None, causal, window, 0.0, 0, threads)
    _score_edits(fn, args, alibi_slopes, softcap, sinks)
    out, lse = _core.sdpa_varlen(arrays[0], arrays[1], arrays[2], cu_q, cu_k, _i64(fn, "max_seqlen_q", max_seqlen_q),
                                 _i64(fn, "max_seqlen_k", max_seqlen_k),
                                 args, bool(return_lse), dtype == "bf16")
    return (out, lse) if return_lse else out


def sdpa_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, d_out: np.ndarray,
                  lse: np.ndarray, *, scale: Optional[float] = None,
                  attn_mask: Union[None, Allowed, Additive, np.ndarray] = None, allowed: Optional[np.ndarray] = None,
                  bias: Optional[np.ndarray] = None, key_padding_mask: Optional[np.ndarray] = None,
                  causal: Optional[Causal] = None, window: int = 0, dropout_p: float = 0.0, seed: int = 0,
                  threads: Optional[int] = None, alibi_slopes: Optional[Any] = None, softcap: float = 0.0,
                  sinks: Optional[Any] = None) -> Tuple[np.ndarray, ...]:
    """Gradients of :func:`sdpa` with respect to q, k and v, given ``d_out = ∂loss/∂out``.

    ``out`` and ``lse`` are what ``sdpa(q, k, v, …, return_lse=True)`` returned for the same inputs;
    every keyword (masks, causal, scale, dropout_p and seed) must be the forward's. Returns
    ``(dq, dk, dv)`` with the shapes of q, k, v (float32). For grouped-query attention dk/dv are
    summed over each group's query heads. With ``sinks``, returns ``(dq, dk, dv, dsinks)``:
    ``dsinks`` (h,) is the gradient of each sink logit, summed over batches and rows. Same memory,
    GIL and error rules as :func:`sdpa`.
    """
    fn = "sdpa_backward"
    arrays = []
    for n, x in (("q", q), ("k", k), ("v", v), ("out", out), ("d_out", d_out)):
        arrays.append(_in_place(_rank4(n, _float_array(n, x, fn), fn)))
    la = _float_array("lse", lse, fn)
    if la.ndim != 3:
        raise ValueError(f"sdpa_backward: lse must be (B, h, T_q) as sdpa(return_lse=True) returns it, "
                         f"got shape {la.shape}")
    la = _in_place(la[..., None])
    args = _args(fn, scale, attn_mask, allowed, bias, key_padding_mask, causal, window, dropout_p, seed, threads)
    _score_edits(fn, args, alibi_slopes, softcap, sinks)
    return _core.sdpa_backward(*arrays, la, args)
