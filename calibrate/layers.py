"""The memory-bound pieces of a transformer step as users write them, timed by ``calibrate compute``.

A user's step (nanoGPT, torchtitan's Llama, Hugging Face's models) runs its matrix products and its
attention core in bf16 under ``torch.autocast``, but much of the rest in fp32: the embedding's output
is fp32 (an fp32 parameter), so the residual stream is fp32 (an fp32 tensor plus a bf16 branch output
is fp32), the norms read and write it in fp32, and every ``nn.Linear`` that reads a norm's output
casts it to bf16 on its own (Llama's separate q, k and v projections: three casts and three bf16
copies kept for the backward). These pieces are many short unfused kernels whose speed no bandwidth
figure predicts well, so each is timed as executed, forward and backward, and the step model
(``autotune.sbp.steptime``) charges its seconds per element:

    layernorm       nn.LayerNorm on the fp32 stream, per element of the (tokens, hidden) input
    rmsnorm         RMSNorm written as Llama's reference writes it (x.float(), pow, mean, rsqrt,
                    product, type_as, times the weight), per element
    cast            a Linear's input cast from fp32 to bf16; backward the bf16 gradient cast back and
                    added to the fp32 gradient of the norm's output, per element, per projection
    cast_up         a bf16 tensor cast to fp32 (a weight's bf16 gradient made the fp32 .grad); backward
                    the fp32 gradient cast back to bf16, per element (the fp32 -> bf16 direction moves the
                    same bytes yet runs faster: one H100, 2026-11-27, 2.0 ps against 3.1-3.9 ps an element)
    residual        the fp32 stream plus a bf16 branch output; backward the branch's gradient cast to
                    bf16 and the stream's two gradients added, per element
    gelu            GELU (exact, nn.GELU's default) on bf16, per element
    swiglu          silu(gate) * up on bf16, per element of the product
    rotary          q * cos + rotate_half(q) * sin on bf16 query and key heads, per element of q and k
    attention_out   the attention's output made token-major (transpose, contiguous); backward its
                    gradient's copy, per output element
    qkv_split       backward only: a fused QKV projection's output split into q, k, v views: their
                    gradients concatenated, per element of the fused output
    loss            F.cross_entropy on bf16 logits under autocast, per logit

Each function takes torch as its first argument (the module imports nothing heavy) and returns
``(forward, backward)``: callables that run one forward, and one forward plus backward, on inputs
made once (``inputs``), so ``calibrate compute`` times both and takes the difference.
"""
from __future__ import annotations

KINDS = ("layernorm", "rmsnorm", "cast", "cast_up", "residual", "gelu", "swiglu", "rotary", "attention_out",
         "qkv_split", "loss")


def _rms(torch, x, weight, eps: float = 1e-5):
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def _rotate_half(torch, x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def pieces(torch, device, tokens: int = 16384, hidden: int = 4096, heads: int = 32, vocabulary: int = 32768):
    """kind -> (elements it is charged per, forward(), forward_and_backward()) for one reference size."""
    bf16, f32 = torch.bfloat16, torch.float32
    head_dim = hidden // heads
    batch = 4
    seq = tokens // batch
    out = {}

    def leaf(*shape, dtype=f32):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    def grad(*shape, dtype=f32):
        return torch.randn(*shape, device=device, dtype=dtype)

    x, g32, g16 = leaf(tokens, hidden), grad(tokens, hidden), grad(tokens, hidden, dtype=bf16)
    ln = torch.nn.LayerNorm(hidden, device=device)
    rw = torch.nn.Parameter(torch.ones(hidden, device=device))

    def with_grad(fn, g):
        def run():
            for t in (x, ln.weight, ln.bias, rw):
                t.grad = None
            fn().backward(g)
        return run

    out["layernorm"] = (tokens * hidden, lambda: ln(x), with_grad(lambda: ln(x), g32))
    out["rmsnorm"] = (tokens * hidden, lambda: _rms(torch, x, rw), with_grad(lambda: _rms(torch, x, rw), g32))

    def cast_fb():
        x.grad = None
        y = x.to(bf16)
        y.backward(g16)
        return x.grad + g32  # the norm output's gradient gathers this projection's
    out["cast"] = (tokens * hidden, lambda: x.to(bf16), cast_fb)

    h16 = leaf(tokens, hidden, dtype=bf16)

    def cast_up_fb():
        h16.grad = None
        h16.to(f32).backward(g32)
    out["cast_up"] = (tokens * hidden, lambda: h16.to(f32), cast_up_fb)

    branch = leaf(tokens, hidden, dtype=bf16)

    def residual_fb():
        x.grad = branch.grad = None
        z = x + branch
        dx, db = torch.autograd.grad(z, (x, branch), g32)
        return dx + g32  # the stream's gradient: through the add and through the branch's norm
    out["residual"] = (tokens * hidden, lambda: x + branch, residual_fb)

    ffn = 4 * hidden
    a, b = leaf(tokens, ffn // 4, dtype=bf16), leaf(tokens, ffn // 4, dtype=bf16)
    ga = grad(tokens, ffn // 4, dtype=bf16)
    gelu = torch.nn.GELU()

    def gelu_fb():
        a.grad = None
        gelu(a).backward(ga)

    def swiglu_fb():
        a.grad = b.grad = None
        (torch.nn.functional.silu(a) * b).backward(ga)
    out["gelu"] = (tokens * ffn // 4, lambda: gelu(a), gelu_fb)
    out["swiglu"] = (tokens * ffn // 4, lambda: torch.nn.functional.silu(a) * b, swiglu_fb)

    kv = heads // 4
    q = leaf(batch, heads, seq, head_dim, dtype=bf16)
    k = leaf(batch, kv, seq, head_dim, dtype=bf16)
    cos, sin = torch.randn(seq, head_dim, device=device), torch.randn(seq, head_dim, device=device)
    gq, gk = grad(batch, heads, seq, head_dim, dtype=bf16), grad(batch, kv, seq, head_dim, dtype=bf16)

    def rotary():
        c, s = cos.to(q.dtype), sin.to(q.dtype)
        return q * c + _rotate_half(torch, q) * s, k * c + _rotate_half(torch, k) * s

    def rotary_fb():
        q.grad = k.grad = None
        rq, rk = rotary()
        torch.autograd.backward((rq, rk), (gq, gk))
    out["rotary"] = (q.numel() + k.numel(), rotary, rotary_fb)

    y = leaf(batch, heads, seq, head_dim, dtype=bf16)
    gy = grad(batch, seq, hidden, dtype=bf16)

    def attention_out():
        return y.transpose(1, 2).contiguous().view(batch, seq, hidden)

    def attention_out_fb():
        y.grad = None
        attention_out().backward(gy)
    out["attention_out"] = (y.numel(), attention_out, attention_out_fb)

    qkv = leaf(batch, seq, 3 * hidden, dtype=bf16)
    parts = [grad(batch, heads, seq, head_dim, dtype=bf16) for _ in range(3)]

    def split():
        return [t.view(batch, seq, heads, head_dim).transpose(1, 2) for t in qkv.split(hidden, dim=2)]

    def split_fb():
        qkv.grad = None
        torch.autograd.backward(split(), parts)
    out["qkv_split"] = (qkv.numel(), split, split_fb)

    n = tokens // 2
    logits = leaf(n, vocabulary, dtype=bf16)
    targets = torch.randint(0, vocabulary, (n,), device=device)
    ce = torch.nn.functional.cross_entropy

    def loss():
        with torch.autocast(device.type if hasattr(device, "type") else "cuda", dtype=bf16):
            return ce(logits, targets)

    def loss_fb():
        logits.grad = None
        loss().backward()
    out["loss"] = (logits.numel(), loss, loss_fb)
    return out
