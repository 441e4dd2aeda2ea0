"""Train a small MLP on the handwritten digits that ship with scikit-learn.

Runs in well under a minute on a laptop CPU:

    python examples/train_digits.py            # local training
    python examples/train_digits.py --epochs 5
"""

import argparse

import flax.linen as nn
import optax

import dlspark


class MLP(nn.Module):
    hidden: int = 128

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(10)(x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--save", default=None, help="checkpoint URL to write at the end (any fsspec URL)")
    args = ap.parse_args(argv)

    train, test = dlspark.datasets.digits()
    net = dlspark.Network(dlspark.Model.from_flax(MLP(), train.features[:1]),
                          loss="softmax_cross_entropy", updater=optax.adam(3e-3), seed=0)
    net.fit(train, epochs=args.epochs, batch_size=args.batch_size, shuffle=True, progress=True)
    acc = float((net.output(test.features).argmax(1) == test.labels.argmax(1)).mean())
    print(f"test accuracy {acc:.4f}  test loss {net.score(test):.4f}  iterations {net.iteration}")
    if args.save:
        net.save(args.save)
        print(f"saved to {args.save}")
    return acc


if __name__ == "__main__":
    main()
