"""A small residual conv net trained on random images whose size changes every step.

Every step draws an image size (a multiple of 32 between 64 and 384 px) and a batch size
(8 to 64, capped by a pixel budget), so every activation, every cuDNN workspace and the
batch-norm buffers change size from one step to the next. ResNet-like: a 3x3 stem, four
stages of two basic blocks (32, 64, 128, 256 channels; stride-2 convolutions between
stages, no pooling layers, whose CUDA backward passes are nondeterministic), global mean,
a linear classifier; SGD with momentum.

    python gpu/workloads/conv_train.py --steps 40 --out-json out.json [--snapshot s.pickle.gz]
    python gpu/workloads/conv_train.py --dry-run
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import torch  # noqa: E402

DEFAULT_STEPS = 40
BATCHES = (8, 12, 16, 24, 32, 48, 64)


def draw_shapes(seed, steps, size_min, size_max, size_step, max_pixels):
    """(batch, size) of every step; batch*size*size <= max_pixels (but batch >= 1)."""
    rng = common.shape_rng(seed, 3)
    sizes = list(range(size_min, size_max + 1, size_step))
    shapes = []
    for _ in range(steps):
        size = rng.choice(sizes)
        batch = rng.choice(BATCHES)
        batch = max(1, min(batch, max_pixels // (size * size)))
        shapes.append((batch, size))
    return shapes


def build_model(classes, widths):
    nn = torch.nn
    F = torch.nn.functional

    def conv_bn(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout))

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.a = conv_bn(cin, cout, stride)
            self.b = conv_bn(cout, cout, 1)
            self.short = None
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                           nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.b(F.relu(self.a(x)))
            return F.relu(y + (x if self.short is None else self.short(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = conv_bn(3, widths[0], 1)
            blocks = []
            cin = widths[0]
            for i, w in enumerate(widths):
                blocks.append(BasicBlock(cin, w, 1 if i == 0 else 2))
                blocks.append(BasicBlock(w, w, 1))
                cin = w
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x):
            x = self.blocks(F.relu(self.stem(x)))
            return self.fc(x.mean(dim=(2, 3)))

    return Net()


def main():
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--widths", default="32,64,128,256")
    p.add_argument("--size-min", type=int, default=64)
    p.add_argument("--size-max", type=int, default=384)
    p.add_argument("--size-step", type=int, default=32)
    p.add_argument("--max-pixels", type=int, default=1_000_000,
                   help="cap on batch*size^2 per step (bounds the peak: ~5 KB per pixel)")
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()
    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    widths = [int(w) for w in args.widths.split(",")]
    shapes = draw_shapes(args.seed, steps, args.size_min, args.size_max, args.size_step,
                         args.max_pixels)
    config = {k: getattr(args, k) for k in (
        "classes", "widths", "size_min", "size_max", "size_step", "max_pixels", "lr")}
    if args.dry_run:
        for i, (b, s) in enumerate(shapes):
            print(f"step {i:3d} batch {b:3d} size {s:4d} pixels {b * s * s}")
        print(f"distinct shapes {len(set(shapes))} of {len(shapes)}")
        return

    def body(h):
        dev = h.device
        with torch.device(dev):
            model = build_model(args.classes, widths)
        model.train()
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        gen = torch.Generator(device=dev).manual_seed(args.seed + 13)
        F = torch.nn.functional
        for batch, size in shapes:
            h.step_begin()
            images = torch.randn(batch, 3, size, size, device=dev, generator=gen)
            labels = torch.randint(0, args.classes, (batch,), device=dev, generator=gen)
            loss = F.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            h.step_end(loss.item(), f"batch {batch} size {size}")
        return {"params": params, "shapes": shapes}

    common.run_workload("conv_train", args, config, body)


if __name__ == "__main__":
    main()
