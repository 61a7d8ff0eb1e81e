"""Transformer-LM training whose batch size and sequence length are drawn every step.

A GPT-style decoder in plain torch (token and position embeddings, pre-norm blocks of
causal self-attention written out as matmul + softmax, and a GELU MLP; the head tied to the
embedding), trained with AdamW and gradient clipping on random tokens. Every step draws a
batch size and a sequence length from the seed, within a token budget, so the activations,
the attention matrices (seq x seq) and the logits change size every step: the pattern that
fragments a caching allocator.

    python gpu/workloads/gpt_train.py --steps 30 --out-json out.json [--snapshot s.pickle.gz]
    python gpu/workloads/gpt_train.py --dry-run      # the shapes only, no GPU
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import torch  # noqa: E402

DEFAULT_STEPS = 30


def draw_shapes(seed, steps, batch_min, batch_max, seq_min, seq_max, max_tokens):
    """(batch, seq) of every step: seq uniform, batch log-uniform, batch*seq <= max_tokens."""
    rng = common.shape_rng(seed, 1)
    shapes = []
    for _ in range(steps):
        seq = rng.randint(seq_min, seq_max)
        batch = common.log_uniform_int(rng, batch_min, batch_max)
        batch = max(1, min(batch, max_tokens // seq))
        shapes.append((batch, seq))
    return shapes


def build_model(vocab, d_model, heads, layers, max_seq):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model)
            self.fc1 = nn.Linear(d_model, 4 * d_model)
            self.fc2 = nn.Linear(4 * d_model, d_model)

        def forward(self, x, causal_mask):
            b, t, d = x.shape
            hd = d // heads
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, hd).permute(2, 0, 3, 1, 4)
            # Written out (not scaled_dot_product_attention): deterministic in both passes,
            # and the (batch, heads, seq, seq) matrices are what a variable seq makes vary.
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = att.masked_fill(causal_mask[:t, :t], float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model)
            self.pos = nn.Embedding(max_seq, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)
            self.head.weight = self.tok.weight
            self.register_buffer(
                "causal_mask", torch.ones(max_seq, max_seq, dtype=torch.bool).triu(1),
                persistent=False)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
            for blk in self.blocks:
                x = blk(x, self.causal_mask)
            return self.head(self.ln_f(x))

    return GPT()


def main():
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch-min", type=int, default=4)
    p.add_argument("--batch-max", type=int, default=32)
    p.add_argument("--seq-min", type=int, default=64)
    p.add_argument("--seq-max", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=6144,
                   help="cap on batch*seq per step (bounds the peak: ~1 MB per token)")
    p.add_argument("--lr", type=float, default=3e-4)
    args = p.parse_args()
    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    shapes = draw_shapes(args.seed, steps, args.batch_min, args.batch_max, args.seq_min,
                         args.seq_max, args.max_tokens)
    config = {k: getattr(args, k) for k in (
        "vocab", "d_model", "heads", "layers", "batch_min", "batch_max", "seq_min", "seq_max",
        "max_tokens", "lr")}
    if args.dry_run:
        for i, (b, t) in enumerate(shapes):
            print(f"step {i:3d} batch {b:3d} seq {t:5d} tokens {b * t}")
        print(f"distinct shapes {len(set(shapes))} of {len(shapes)}")
        return

    def body(h):
        dev = h.device
        with torch.device(dev):
            model = build_model(args.vocab, args.d_model, args.heads, args.layers, args.seq_max)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        gen = torch.Generator(device=dev).manual_seed(args.seed + 7)
        F = torch.nn.functional
        for batch, seq in shapes:
            h.step_begin()
            tokens = torch.randint(0, args.vocab, (batch, seq + 1), device=dev, generator=gen)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            del logits
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            h.step_end(loss.item(), f"batch {batch} seq {seq}")
        return {"params": params, "shapes": shapes}

    common.run_workload("gpt_train", args, config, body)


if __name__ == "__main__":
    main()
