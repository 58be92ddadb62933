#!/usr/bin/python3
"""The lessons (../shared/lessons/) run on mha, through its Python API.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/lessons.py

1. The seeds' worked example: X (3 tokens, d_model 4), W_Q = W_K = W_V = I, 2 heads; head 0's
   scaled scores are [[0.71, 0, 0.71], [0, 0.71, 0.71], [0.71, 0.71, 1.41]].
2. The 4·d² parameter claim (four d×d projections, no biases).
3. Causal and padding masks: what each query may see.
4. Grouped-query attention's KV-cache saving.
5. A tiny model with mha.torch.MultiheadAttention trained in a torch optimiser loop until its loss
   falls (only when PyTorch is installed; otherwise it says so and skips that part).
"""
import sys

import numpy as np

import mha


def worked_example() -> None:
    X = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]], np.float32)
    # Q = K = V = X split into 2 heads of 2 features: (B=1, h=2, n=3, d=2)
    heads = X.reshape(3, 2, 2).transpose(1, 0, 2)[None]
    out, w, lse = mha.sdpa(heads, heads, heads, return_weights=True, return_lse=True)
    # softmax(s)_j = exp(s_j − lse), so the scaled scores are log(w) + lse
    scores = np.log(w[0, 0]) + lse[0, 0][:, None]
    expected = np.array([[0.71, 0, 0.71], [0, 0.71, 0.71], [0.71, 0.71, 1.41]])
    print("1. head-0 scores (QKᵀ/√2):\n", np.round(scores, 2) + 0.0)
    assert np.allclose(np.round(scores, 2), expected), scores
    # The same through the module with identity projections and output: concat(heads) = out
    m = mha.MultiheadAttention(4, 2, bias=False, batch_first=True).eval()
    m.load_state_dict({"in_proj_weight": np.concatenate([np.eye(4)] * 3).astype(np.float32),
                       "out_proj.weight": np.eye(4, dtype=np.float32)})
    y, _ = m(X[None], X[None], X[None])
    assert np.allclose(y[0], out[0].transpose(1, 0, 2).reshape(3, 4), atol=1e-6)
    print("   module output (W = I) equals concat(heads):\n", np.round(y[0], 3))


def parameter_claim() -> None:
    for d in (64, 512, 4096):
        n = mha.MultiheadAttention(d, 8, bias=False).parameter_count()
        assert n == 4 * d * d
        print(f"2. d_model = {d:5d}: {n:>11,d} parameters = 4·d² (W_Q, W_K, W_V, W_O)")


def masks() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)
    m = mha.MultiheadAttention(8, 2, batch_first=True).eval()
    _, w = m(x, x, x, is_causal=True)
    print("3. causal (is_causal=True): query i sees keys ≤ i\n", (w[0] > 0).astype(int))
    assert np.all(np.triu(w, 1) == 0)
    pad = np.array([[False] * 4, [False, False, True, True]])  # sequence 1 has 2 real tokens
    _, w = m(x, x, x, key_padding_mask=pad)
    print("   key_padding_mask (True = padding), sequence 1:\n", (w[1] > 0).astype(int))
    assert np.all(w[1][:, 2:] == 0)


def gqa_cache() -> None:
    full = mha.MultiheadAttention(512, 8).new_cache(batch=1, capacity=4096)
    for kv in (8, 2, 1):
        c = mha.MultiheadAttention(512, 8, num_kv_heads=kv).new_cache(batch=1, capacity=4096)
        print(f"4. h = 8, kv = {kv}: KV cache {c.nbytes / 2**20:5.1f} MiB for 4096 tokens "
              f"({full.nbytes // c.nbytes}× smaller than MHA)")
    assert full.nbytes == 8 * mha.MultiheadAttention(512, 8, num_kv_heads=1).new_cache(1, 4096).nbytes


def train_tiny_model() -> None:
    try:
        import torch
    except ImportError:
        print("5. PyTorch is not installed: skipping the training loop (apt-get install python3-torch)")
        return
    import mha.torch as mt
    torch.manual_seed(0)
    # Task: copy the token at position 0 to every position (the model must attend to key 0).
    vocab, T, E = 8, 6, 16
    emb, pos = torch.nn.Embedding(vocab, E), torch.nn.Parameter(0.1 * torch.randn(T, E))
    attn = mt.MultiheadAttention(E, 2, batch_first=True)
    head = torch.nn.Linear(E, vocab)
    params = list(emb.parameters()) + [pos] + list(attn.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=3e-2)
    losses = []
    for step in range(150):
        tokens = torch.randint(0, vocab, (32, T))
        x = emb(tokens) + pos
        y, _ = attn(x, x, x, need_weights=False)
        loss = torch.nn.functional.cross_entropy(head(y).reshape(-1, vocab), tokens[:, :1].expand(-1, T).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"5. training mha.torch.MultiheadAttention: loss {losses[0]:.3f} → {losses[-1]:.3f}")
    assert losses[-1] < 0.5 * losses[0], losses


if __name__ == "__main__":
    worked_example()
    parameter_claim()
    masks()
    gqa_cache()
    train_tiny_model()
    print("all lessons reproduced on mha", mha.__version__)
    sys.exit(0)
