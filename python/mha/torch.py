"""PyTorch interop (importable only when torch is installed).

* :class:`MultiheadAttention`: a ``torch.nn.Module`` with torch.nn.MultiheadAttention's constructor,
  forward and ``nn.Parameter`` names, computing with mha; gradients flow through a
  ``torch.autograd.Function`` that calls mha's forward_train / backward.
  ``model.self_attn = mha.torch.MultiheadAttention.from_torch(model.self_attn)`` swaps it in.
* :func:`scaled_dot_product_attention`: ``torch.nn.functional.scaled_dot_product_attention``'s
  signature and semantics (boolean mask True = take part), with autograd.

Float32 CPU tensors only; anything else raises TypeError. Works with torch 1.13 and 2.x. Both
give first derivatives (a backward with ``create_graph=True`` raises RuntimeError; the module not a second backward through one graph
either: it releases its activations after the first, as torch does), none for a float mask (a mask
that requires grad is refused), and dropout masks drawn from torch's generator (``torch.manual_seed`` reproduces them;
they differ from PyTorch's own). The module deep-copies and pickles (nn.TransformerEncoder stacks
copies of its layer).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np
import torch as _torch

from . import _core
from ._functional import (_args, _finite, _i64, _in_place, _named_errors, _number, _optional_count,
                          _per_head, _probability)
from ._module import Rope, _f32, _forward_args

__all__ = ["MultiheadAttention", "scaled_dot_product_attention"]


def _check(name: str, t: Any, fn: str) -> None:
    if not isinstance(t, _torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != _torch.float32 or t.device.type != "cpu":
        raise TypeError(f"{fn}: {name} must be a float32 CPU tensor (mha computes in float32 on the CPU), "
                        f"got {t.dtype} on {t.device}")


def _np(t: _torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _np3(query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor):
    """numpy views of the three inputs; one array for a tensor passed more than once (self-attention),
    so mha projects Q, K and V with one packed GEMM."""
    q = _np(query)
    k = q if key is query else _np(key)
    v = q if value is query else (k if value is key else _np(value))
    return q, k, v


def _mask_np(m: Optional[_torch.Tensor], name: str, fn: str, uint8: bool = False) -> Optional[np.ndarray]:
    """A mask as numpy: a torch tensor, bool or floating point (uint8 too where ``uint8``: torch 1.13
    still takes a uint8 attn_mask, deprecated, but no uint8 key_padding_mask), as torch checks it."""
    if m is None:
        return None
    if not isinstance(m, _torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor or None, got {type(m).__name__}")
    if not (m.dtype == _torch.bool or m.dtype.is_floating_point or (uint8 and m.dtype == _torch.uint8)):
        kinds = "bool, uint8 or float" if uint8 else "bool or float"
        raise TypeError(f"{fn}: {name} must be a {kinds} tensor, got {m.dtype}")
    if m.requires_grad and _torch.is_grad_enabled():
        # Its gradient would be dL/dS (T_q × T_k per head), which mha's fused backward never forms:
        # refused rather than silently left at None.
        raise ValueError(f"{fn}: {name} requires grad, but mha gives no gradient for masks; pass "
                         f"{name}.detach() (or compute a learned bias with torch's own attention)")
    m = m.detach().cpu()
    # numpy has no bfloat16: widened (exactly) to float32, as torch takes a bf16 mask.
    return (m.float() if m.dtype == _torch.bfloat16 else m).numpy()


_MODULE_HEADS = ("MultiheadAttention.forward", "forward_train")  # what the core's forwards call themselves


# with_score_options' arguments (ALiBi slopes, softcap, sinks, scale) when no edit is asked for.
_NO_SCORE_EDITS: Tuple[Any, ...] = ([], 0.0, False, None)


def _score_edits(fn: str, scale: Any, alibi_slopes: Any, softcap: Any, attention_sinks: Any) -> Tuple[Any, ...]:
    """The score edits in with_score_options' order. Types are checked here, and the values the
    library would not name the argument of (a non-finite slope, by _per_head; a softcap that is
    neither 0 nor a finite c > 0); the slope count and the scale's finiteness by the library
    (ValueError). A softcap of None or 0 is off, as in the numpy module and the library."""
    slopes = [] if alibi_slopes is None else _per_head("alibi_slopes", alibi_slopes, fn)
    c = 0.0
    if softcap is not None:
        c = _number(fn, "softcap", softcap)
        if c != 0 and not (c > 0 and np.isfinite(c)):
            raise ValueError(f"{fn}: softcap must be a finite c > 0 (None or 0 turns it off), got {c}")
    if not isinstance(attention_sinks, (bool, np.bool_)):
        raise TypeError(f"{fn}: attention_sinks must be a bool, got {type(attention_sinks).__name__}")
    return slopes, c, bool(attention_sinks), None if scale is None else _number(fn, "scale", scale)


def _first_derivatives_only(fn: str) -> None:
    """Refuses a backward asked to build a graph of its own (create_graph=True: torch runs backward
    with grad mode on exactly then). mha's backward is not differentiable, and torch's
    once_differentiable, which this replaces, let it through whenever the incoming gradients did not
    require grad: the gradients came back as constants, and a gradient penalty through them was
    refused later with a misleading message, or silently lost mha's share of the second derivative."""
    if _torch.is_grad_enabled():
        raise RuntimeError(f"{fn}: double backward (create_graph=True) is not supported: mha's backward gives "
                           "first derivatives only")


def _dropout_seed(p: float) -> int:
    """A dropout seed from torch's generator: torch.manual_seed reproduces the masks, and every call
    (every layer, every step) draws its own."""
    takes = isinstance(p, (int, float, np.integer, np.floating)) and not isinstance(p, (bool, np.bool_)) and p > 0
    return int(_torch.randint(0, 2**62, (1,)).item()) if takes else 0


class _ModuleFunction(_torch.autograd.Function):
    """Output of mha's module forward_train; backward() returns every input's and parameter's gradient."""

    @staticmethod
    def forward(ctx, core, args, names, query, key, value, *params):  # type: ignore[override]
        # `core` is this call's own module, holding copies of `params` (MultiheadAttention.forward):
        # the backward uses it as it is, whatever later forwards (other threads, other tensors through
        # torch.func.functional_call) bind.
        out, saved = core.forward_train(*_np3(query, key, value), args)
        ctx.core, ctx.saved, ctx.names = core, saved, names
        # Saved so that torch checks they were not modified in place before the backward.
        ctx.save_for_backward(*params)
        return _torch.from_numpy(out)

    @staticmethod
    def backward(ctx, d_output):  # type: ignore[override]
        _first_derivatives_only("mha.torch.MultiheadAttention")
        if ctx.saved is None:
            raise RuntimeError("mha.torch.MultiheadAttention: this graph's backward already ran and released mha's "
                               "saved activations; backward through it a second time (retain_graph=True) is not "
                               "supported: run the forward again")
        ctx.saved_tensors  # noqa: B018 (raises if a parameter was modified in place since the forward)
        g = ctx.core.backward(ctx.saved, _np(d_output))
        # Released now, as torch releases its own saved tensors: kept until the graph died, they held
        # a second set of activations through the next step's forward in a training loop.
        ctx.saved = None
        ctx.core = None  # this call's copy of the parameters, likewise
        t = lambda a: None if a is None else _torch.from_numpy(a)  # noqa: E731
        return (None, None, None, t(g["query"]), t(g["key"]), t(g["value"]), *[t(g.get(n)) for n in ctx.names])


class MultiheadAttention(_torch.nn.Module):
    """torch.nn.MultiheadAttention, computed by mha.

    Same constructor (positional order included), same forward, same parameters and state_dict
    names (``in_proj_weight`` or ``q/k/v_proj_weight``, ``in_proj_bias``, ``bias_k``, ``bias_v``,
    ``out_proj.weight``, ``out_proj.bias``), initialised as PyTorch does from torch's generator.
    Keyword-only extras: ``num_kv_heads`` (grouped-query attention) and ``rope`` (:class:`mha.Rope`),
    and the score edits of :class:`mha.MultiheadAttention` (docs/semantics.md, 'Score edits'):
    ``scale`` (the softmax scale; None: 1/sqrt(head_dim)), ``alibi_slopes`` (one per head, constants;
    ``mha.alibi_slopes(num_heads)`` is the standard schedule; not with ``add_bias_kv`` or
    ``add_zero_attn``), ``softcap`` (c > 0: scaled scores s → c·tanh(s/c); None or 0: off) and
    ``attention_sinks`` (True: an ``nn.Parameter`` ``sinks`` of shape (num_heads,), zeros at init,
    one logit per head that joins every row's softmax denominator without a value, trained like the
    others; returned weights then sum to less than 1 per row). A wrong slope count, a softcap <= 0
    or a non-finite value raises ValueError naming the argument. They are fixed at construction
    (read-only attributes of the same names) and kept by deep copies and pickles; ``from_torch``
    sets none (torch's module has none).

    Each forward copies the current parameters into a module of its own (O(parameters)), which its
    backward uses: threads may share one module, and torch refuses the backward of a graph whose
    parameters were modified in place after its forward (as for its own module). Those per-call
    modules share this module's workspace: the large working buffers (projections, attention heads,
    the backward's gradient rows) are reused from call to call, as the numpy module's are, each
    concurrent call checking out buffers of its own.
    ``batch_first``, ``dropout`` and ``add_zero_attn`` may be changed between calls, as torch's
    forward reads them on every call. ``dropout`` must be in [0, 1): torch also takes 1.0 (every
    probability dropped, the output out_proj's bias), which mha refuses with ValueError.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device: Any = None, dtype: Any = None, *,
                 num_kv_heads: Optional[int] = None, rope: Optional[Rope] = None, scale: Optional[float] = None,
                 alibi_slopes: Optional[Any] = None, softcap: Optional[float] = None, attention_sinks: bool = False):
        super().__init__()
        if device is not None and _torch.device(device).type != "cpu":
            raise TypeError(f"mha.torch.MultiheadAttention: CPU only, got device={device}")
        if dtype is not None and dtype != _torch.float32:
            raise TypeError(f"mha.torch.MultiheadAttention: float32 only, got dtype={dtype}")
        fn = "mha.torch.MultiheadAttention"
        widths = [_optional_count(fn, name, val, default) for name, val, default in
                  (("num_kv_heads", num_kv_heads, "num_heads"), ("kdim", kdim, "embed_dim"), ("vdim", vdim, "embed_dim"))]
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        # Whether Q/K/V share one packed in_proj_weight (torch's _qkv_same_embed_dim).
        self._packed_in_proj = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        self.rope = rope
        # The core's constructor arguments: __setstate__ rebuilds it from them (a deep copy, a pickle).
        p = _probability(fn, "dropout", float(dropout))
        self._core_args = (_i64(fn, "embed_dim", embed_dim), _i64(fn, "num_heads", num_heads), *widths, bool(bias),
                           bool(add_bias_kv), bool(add_zero_attn), p, bool(batch_first),
                           rope is not None, float(rope.theta if rope else 10000.0), int(rope.dims if rope else 0),
                           str(rope.pairing if rope else "half_split"), 0, 0)
        self._score_args = _score_edits(fn, scale, alibi_slopes, softcap, attention_sinks)
        # Validates everything (raises ValueError with the library's message) and gives the shapes.
        with _named_errors(fn, ("MhaConfig",)):
            self._core = self._new_core(self._core_args)
        cfg = self._core.config()
        self.num_kv_heads = cfg["num_kv_heads"]
        self.head_dim = cfg["head_dim"]
        shapes = {n: self._core.get(n).shape for n in self._core.param_names()}
        P = lambda n: _torch.nn.Parameter(_torch.empty(shapes[n])) if n in shapes else None  # noqa: E731
        if self._packed_in_proj:
            self.in_proj_weight = P("in_proj_weight")
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = P("q_proj_weight")
            self.k_proj_weight = P("k_proj_weight")
            self.v_proj_weight = P("v_proj_weight")
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = P("in_proj_bias")
        else:
            self.register_parameter("in_proj_bias", None)
        linear = getattr(_torch.nn.modules.linear, "NonDynamicallyQuantizableLinear", _torch.nn.Linear)
        self.out_proj = linear(cfg["num_heads"] * cfg["head_dim"], embed_dim, bias=bias)
        if add_bias_kv:
            self.bias_k = P("bias_k")
            self.bias_v = P("bias_v")
        else:
            self.bias_k = self.bias_v = None
        self.sinks = P("sinks")  # None without attention_sinks, as bias_k is without add_bias_kv
        self._reset_parameters()

    # The score edits as the constructor took them (read-only: the core is built with them).
    scale = property(lambda self: self._score_args[3])
    alibi_slopes = property(lambda self: tuple(self._score_args[0]) or None)
    softcap = property(lambda self: self._score_args[1] or None)
    attention_sinks = property(lambda self: self._score_args[2])

    def _new_core(self, args: Tuple[Any, ...]) -> "_core.Module":
        """The core for constructor arguments ``args`` (_core_args), with this module's score edits."""
        core = _core.Module(*args)
        return core if self._score_args == _NO_SCORE_EDITS else core.with_score_options(*self._score_args)

    @property
    def _qkv_same_embed_dim(self) -> bool:
        """False, always. torch's nn.TransformerEncoder(Layer) inference fast path (eval mode, no
        grad, batch_first) tests this flag of its self_attn and, when True, reads in_proj_weight and
        out_proj and runs its own fused kernel, never calling this module's forward: mha would not
        compute, and RoPE or grouped-query heads would be dropped or fail inside torch. False sends
        those layers through forward, as for torch's own module with kdim or vdim set."""
        return False

    # The core holds no parameters of use between calls (each forward binds the current ones into a
    # module of its own), so a copy or a pickle carries its constructor arguments and builds a fresh one.
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_core"] = None
        return state

    def __setstate__(self, state):
        if "_packed_in_proj" not in state:  # pickled before the flag was renamed
            state["_packed_in_proj"] = state.pop("_qkv_same_embed_dim", True)
        state.setdefault("_score_args", _NO_SCORE_EDITS)  # pickled before the score edits existed
        super().__setstate__(state)
        self._core = self._new_core(self._core_args)

    # Where _core_args holds the settings that torch's forward reads from attributes on every call.
    _LIVE_ARGS = {"add_zero_attn": (7, bool), "dropout": (8, float), "batch_first": (9, bool)}

    def _sync_core(self, fn: str) -> None:
        """Rebuilds the core when batch_first, dropout or add_zero_attn changed since it was built."""
        args = list(self._core_args)
        for attr, (i, kind) in self._LIVE_ARGS.items():
            value = getattr(self, attr)
            # (torch takes dropout=False as 0.0, and so does float(): bool is an int)
            if kind is float and not isinstance(value, (int, float, np.integer, np.floating, np.bool_)):
                raise TypeError(f"{fn}: {attr} must be a float, got {type(value).__name__}")
            args[i] = kind(value)
        args[8] = _probability(fn, "dropout", args[8])
        if tuple(args) != self._core_args:
            with _named_errors(fn, ("MhaConfig",)):
                core = self._new_core(tuple(args))  # validates (ValueError) before anything is replaced
            self._core, self._core_args = core, tuple(args)

    def release_workspace(self) -> None:
        """Frees the working buffers the module keeps between calls to reuse them (projections,
        attention heads and a backward's gradient rows: about 32·B·T·E bytes after training steps
        of self-attention at one shape, 16·B·T·E after inference; the pool keeps up to 8 of the
        largest buffers calls gave back, so with shapes that vary, 2–3× that for the largest B·T
        seen; each layer keeps its own); the next call allocates afresh."""
        self._core.release_workspace()

    def _reset_parameters(self) -> None:
        """PyTorch's initialisation: Xavier-uniform input projections, zero biases, Xavier-normal bias_k/v
        (and zero sinks, as mha.MultiheadAttention)."""
        if self._packed_in_proj:
            _torch.nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            _torch.nn.init.xavier_uniform_(self.q_proj_weight)
            _torch.nn.init.xavier_uniform_(self.k_proj_weight)
            _torch.nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            _torch.nn.init.constant_(self.in_proj_bias, 0.0)
            _torch.nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            _torch.nn.init.xavier_normal_(self.bias_k)
            _torch.nn.init.xavier_normal_(self.bias_v)
        if self.sinks is not None:
            _torch.nn.init.zeros_(self.sinks)  # as mha.MultiheadAttention: the sink starts at e^0

    @classmethod
    def from_torch(cls, old: "_torch.nn.MultiheadAttention") -> "MultiheadAttention":
        """The same configuration, parameters (copied) and training mode as a torch.nn.MultiheadAttention."""
        if not isinstance(old, _torch.nn.MultiheadAttention):
            raise TypeError(f"from_torch: expected a torch.nn.MultiheadAttention, got {type(old).__name__}")
        new = cls(old.embed_dim, old.num_heads, dropout=old.dropout, bias=old.in_proj_bias is not None,
                  add_bias_kv=old.bias_k is not None, add_zero_attn=old.add_zero_attn, kdim=old.kdim, vdim=old.vdim,
                  batch_first=old.batch_first)
        new.load_state_dict(old.state_dict())
        # Frozen parameters stay frozen (fine-tuning freezes some; an optimiser must not train them).
        for name, p in old.named_parameters():
            new.get_parameter(name).requires_grad_(p.requires_grad)
        new.train(old.training)
        return new

    def _param_items(self):
        """(name, tensor) of the core's parameters, read as torch's module reads them (attributes,
        not named_parameters()): so pruning, parametrizations and torch.func.functional_call, which
        put other tensors in those attributes, reach the computation and their gradients."""
        items = []
        for n in self._core.param_names():
            owner, _, attr = n.rpartition(".")
            t = getattr(self.get_submodule(owner) if owner else self, attr, None)
            if t is not None:
                items.append((n, t))
        return items

    def forward(self, query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor,
                key_padding_mask: Optional[_torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[_torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[_torch.Tensor, Optional[_torch.Tensor]]:
        """torch.nn.MultiheadAttention.forward: same arguments, mask polarity and return value.

        When gradients are needed, the output comes from mha's forward_train (for backward); if
        attention weights are asked for too (``need_weights=True``, PyTorch's default), they come
        from a second, weights-only forward and carry no gradient. Pass ``need_weights=False``
        in training (as TransformerEncoderLayer does) to run one pass.
        """
        fn = "mha.torch.MultiheadAttention"
        for n, t in (("query", query), ("key", key), ("value", value)):
            _check(n, t, fn)
        self._sync_core(fn)
        items = self._param_items()
        for n, p in items:
            _check(n, p, fn)
        params = {n: _np(p) for n, p in items}
        if "sinks" in params:  # (the library's own message names an "sdpa" the user never called)
            _finite(fn + ".forward", "sinks", params["sinks"].tolist())
        # This call's own module with the current parameters: the shared core is never written, so
        # threads may call forward (and backward) on one module at once, as on torch's. It keeps its
        # working buffers in the shared core's workspace, which hands each concurrent call its own.
        core = self._core.with_params(params)
        training = self.training and self.dropout > 0.0
        seed = _dropout_seed(self.dropout) if training else 0
        kpm = _mask_np(key_padding_mask, "key_padding_mask", fn)
        am = _mask_np(attn_mask, "attn_mask", fn, uint8=True)
        needs_grad = _torch.is_grad_enabled() and (any(t.requires_grad for t in (query, key, value))
                                                   or any(p.requires_grad for _, p in items))
        weights = None
        with _named_errors(fn + ".forward", _MODULE_HEADS):
            if need_weights or not needs_grad:
                need = "none" if not need_weights else ("averaged" if average_attn_weights else "per_head")
                args = _forward_args(fn, kpm, am, is_causal, need, training, seed, 0)
                out, w, _ = core.forward(*_np3(query, key, value), args)
                weights = None if w is None else _torch.from_numpy(w)
                if not needs_grad:
                    return _torch.from_numpy(out), weights
            args = _forward_args(fn, kpm, am, is_causal, "none", training, seed, 0)
            names = [n for n, _ in items]
            out = _ModuleFunction.apply(core, args, names, query, key, value, *[p for _, p in items])
        return out, weights


class _SdpaFunction(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, args, q, k, v):  # type: ignore[override]
        out, _, lse = _core.sdpa(_np(q), _np(k), _np(v), args, False, True, False)
        out_t = _torch.from_numpy(out)
        # Saved as tensors, not as numpy views of them: torch then refuses a backward after any of
        # them (the output included) was modified in place, as for its own attention.
        ctx.args, ctx.lse = args, lse
        ctx.save_for_backward(q, k, v, out_t)
        return out_t

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        _first_derivatives_only("mha.torch.scaled_dot_product_attention")
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = _core.sdpa_backward(_np(q), _np(k), _np(v), _np(out), _np(d_out), ctx.lse[..., None], ctx.args)
        return None, _torch.from_numpy(dq), _torch.from_numpy(dk), _torch.from_numpy(dv)


def scaled_dot_product_attention(query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor,
                                 attn_mask: Optional[_torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> _torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention, computed by mha, with autograd.

    query (N, h, L, E) or (N, L, E); key/value (N, kv, S, ·) or (N, S, ·) (kv may divide h: grouped-query,
    whether or not ``enable_gqa`` says so: it is taken for torch 2.5's signature).
    A boolean ``attn_mask`` is True where attention is allowed (PyTorch's SDPA polarity, the
    opposite of nn.MultiheadAttention's); a float one is added. ``is_causal`` is top-left (query i
    sees keys ≤ i) and, as in PyTorch, may not be combined with ``attn_mask``. Dropout uses mha's
    counter-based generator, seeded from torch's generator (masks differ from PyTorch's).
    """
    fn = "scaled_dot_product_attention"
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"{fn}: enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    for n, t in (("query", query), ("key", key), ("value", value)):
        _check(n, t, fn)
    if is_causal and attn_mask is not None:
        raise ValueError(f"{fn}: attn_mask and is_causal cannot both be set (as in PyTorch)")
    shapes = f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
    three = query.dim() == 3 and key.dim() == 3 and value.dim() == 3
    if three:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"{fn}: expected query/key/value all 3-D or all 4-D, got {shapes}")
    allowed = bias = None
    if attn_mask is not None:
        m = _mask_np(attn_mask, "attn_mask", fn)
        if m.dtype != np.bool_:
            # Narrowed as the caller passed it, before the reshape below: a float64 entry past
            # float32's range is a ValueError naming its index in the caller's mask (not an
            # infinite bias, nor an index into the (N, 1, L, S) view of a 3-D one).
            m = _f32("attn_mask", m, fn)
        if three and m.ndim == 3:
            m = m[:, None]
        # Checked here, in the caller's terms: the core names its own "allowed mask" / "additive
        # mask" and the 4-D shape it made of the caller's.
        want = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        try:
            fits = m.ndim <= 4 and np.broadcast_shapes(m.shape, want) == want
        except ValueError:
            fits = False
        if not fits:
            expected = f"(N, L, S) = {(want[0], want[2], want[3])}" if three else f"(N, h, L, S) = {want}"
            raise ValueError(f"{fn}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {expected}")
        # (An integer 0/1 mask would be added to the scores: _mask_np refuses it, as PyTorch 2's SDPA does.)
        if m.dtype == np.bool_:
            allowed = m
        else:
            bias = m
    seed = _dropout_seed(dropout_p)
    from ._functional import Causal
    args = _args(fn, scale, None, allowed, bias, None, Causal.top_left() if is_causal else None, 0, float(dropout_p),
                 seed, None)
    with _named_errors(fn, ("sdpa",)):  # the core's shape errors name the function the caller called
        out = _SdpaFunction.apply(args, query, key, value)
    return out.squeeze(1) if three else out


del math, _in_place
