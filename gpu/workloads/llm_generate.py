"""LLM-style inference: requests of varied batch size and prompt length, greedy decoding with
a KV cache that grows by torch.cat one token at a time.

The model is a small Llama-shaped decoder in plain torch, randomly initialised in bf16 (nothing
is downloaded): RMSNorm, fused QKV projection, scaled_dot_product_attention (flash, not
cuDNN's), SwiGLU MLP, untied LM head. The decode loop is written out so that each layer's
cache (keys and values in one tensor) is replaced every token by
`torch.cat([cache, new], dim=seq)`: a block one token larger is allocated while the old one
is still live, then the old one is freed, as in Hugging Face's DynamicCache. Every token
ends with the host reading whether all sequences finished (as `generate` does), so the host
waits for the GPU each token.

Each request is one "step": its duration, and as its "loss" the mean top logit over its
generated tokens (a bit-exact check that every allocator computed the same thing).

    python gpu/workloads/llm_generate.py --steps 5 --out-json out.json
    python gpu/workloads/llm_generate.py --dry-run
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import torch  # noqa: E402

DEFAULT_REQUESTS = 5


def draw_requests(seed, requests, batch_min, batch_max, prompt_min, prompt_max, new_min,
                  new_max):
    """(batch, prompt_len, new_tokens) of every request."""
    rng = common.shape_rng(seed, 2)
    out = []
    for _ in range(requests):
        batch = common.log_uniform_int(rng, batch_min, batch_max)
        prompt = common.log_uniform_int(rng, prompt_min, prompt_max)
        new = rng.randint(new_min, new_max)
        out.append((batch, prompt, new))
    return out


def build_model(vocab, d_model, heads, layers, ffn, max_pos):
    nn = torch.nn
    F = torch.nn.functional
    hd = d_model // heads

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.Parameter(torch.ones(d_model))
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
            self.o = nn.Linear(d_model, d_model, bias=False)
            self.norm2 = nn.Parameter(torch.ones(d_model))
            self.gate_up = nn.Linear(d_model, 2 * ffn, bias=False)
            self.down = nn.Linear(ffn, d_model, bias=False)

        def forward(self, x, cache):
            """x: (batch, t, d). cache: (2, batch, heads, past, hd) or None. Returns x and
            the new cache."""
            b, t, d = x.shape
            qkv = self.qkv(F.rms_norm(x, (d,), self.norm1)).view(b, t, 3, heads, hd)
            q = qkv[:, :, 0].transpose(1, 2)
            kv_new = qkv[:, :, 1:].permute(2, 0, 3, 1, 4)
            kv = kv_new.contiguous() if cache is None else torch.cat([cache, kv_new], dim=3)
            y = F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=cache is None and t > 1)
            x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
            g, u = self.gate_up(F.rms_norm(x, (d,), self.norm2)).chunk(2, dim=-1)
            return x + self.down(F.silu(g) * u), kv

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model)
            self.pos = nn.Embedding(max_pos, d_model)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = nn.Parameter(torch.ones(d_model))
            self.head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, idx, start, caches):
            """Logits of the last position only (as generation needs), and the caches."""
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(start, start + t, device=idx.device))
            new_caches = []
            for layer, cache in zip(self.layers, caches):
                x, kv = layer(x, cache)
                new_caches.append(kv)
            x = F.rms_norm(x[:, -1:], (x.shape[-1],), self.norm)
            return self.head(x)[:, 0], new_caches

    return Decoder()


def main():
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--batch-min", type=int, default=1)
    p.add_argument("--batch-max", type=int, default=32)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--new-min", type=int, default=48,
                   help="fewest tokens generated per request")
    p.add_argument("--new-max", type=int, default=160)
    args = p.parse_args()
    requests = args.steps if args.steps is not None else DEFAULT_REQUESTS
    plan = draw_requests(args.seed, requests, args.batch_min, args.batch_max, args.prompt_min,
                         args.prompt_max, args.new_min, args.new_max)
    config = {k: getattr(args, k) for k in (
        "vocab", "d_model", "heads", "layers", "ffn", "batch_min", "batch_max", "prompt_min",
        "prompt_max", "new_min", "new_max")}
    if args.dry_run:
        for i, (b, pl, n) in enumerate(plan):
            print(f"request {i:2d} batch {b:3d} prompt {pl:5d} new {n:4d}")
        print(f"tokens decoded {sum(n for _, _, n in plan)}")
        return

    def body(h):
        dev = h.device
        max_pos = args.prompt_max + args.new_max
        with torch.device(dev):
            model = build_model(args.vocab, args.d_model, args.heads, args.layers, args.ffn,
                                max_pos).to(torch.bfloat16)
        model.eval()
        params = sum(p.numel() for p in model.parameters())
        gen = torch.Generator(device=dev).manual_seed(args.seed + 11)
        eos = args.vocab  # never produced: every request decodes all its tokens
        token_checksum = 0
        tokens_total = 0
        # Not cuDNN's attention, PyTorch's first choice on Hopper: it builds a plan for every
        # new sequence length (about 60 ms a token on an H100) and its results vary from run
        # to run. Flash attention is fast and bit-reproducible.
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with torch.inference_mode(), sdpa_kernel(backends):
            for batch, prompt_len, new in plan:
                h.step_begin()
                prompt = torch.randint(0, args.vocab, (batch, prompt_len), device=dev,
                                       generator=gen)
                logits, caches = model(prompt, 0, [None] * args.layers)
                score = torch.zeros((), dtype=torch.float32, device=dev)
                finished = torch.zeros(batch, dtype=torch.bool, device=dev)
                generated = []
                for i in range(new):
                    top, tok = logits.float().max(dim=-1)
                    score += top.sum()
                    generated.append(tok)
                    finished |= tok == eos
                    if bool(finished.all()) or i == new - 1:
                        break
                    logits, caches = model(tok[:, None], prompt_len + i, caches)
                out = torch.stack(generated, dim=1)
                del caches, logits
                weights = torch.arange(1, out.numel() + 1, device=dev, dtype=torch.int64)
                weighted = int((out.reshape(-1) * weights).sum())
                token_checksum = (token_checksum + weighted) % (1 << 61)
                tokens_total += out.numel()
                h.step_end(score.item() / out.numel(),
                           f"batch {batch} prompt {prompt_len} new {out.shape[1]}")
        return {"params": params, "requests": plan, "token_checksum": token_checksum,
                "tokens_generated": tokens_total}

    common.run_workload("llm_generate", args, config, body)


if __name__ == "__main__":
    main()
