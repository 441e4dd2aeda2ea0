"""Train an MLP on the handwritten digits that ship with scikit-learn, on the embedded cluster.

    python examples/train_digits.py              # parameter averaging on an embedded LocalCluster
    python examples/train_digits.py --sharing    # gradient sharing instead
    python examples/train_digits.py --local      # one process, no cluster

Under a minute on a laptop CPU.
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
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--local", action="store_true", help="train in this process, without a cluster")
    ap.add_argument("--sharing", action="store_true", help="gradient sharing instead of parameter averaging")
    ap.add_argument("--save", default=None, help="checkpoint URL to write at the end (any fsspec URL)")
    args = ap.parse_args(argv)

    train, test = dlspark.datasets.digits()
    net = dlspark.Network(dlspark.Model.from_flax(MLP(), train.features[:1]),
                          loss="softmax_cross_entropy", updater=optax.adam(3e-3), seed=0)
    if args.local:
        net.fit(train, epochs=args.epochs, batch_size=args.batch_size, shuffle=True, progress=True)
        evaluation = dlspark.evaluation.Evaluation()
        evaluation.update(test.labels, net.output(test.features))
    else:
        if args.sharing:
            master = dlspark.GradientSharing(batch_size_per_worker=args.batch_size,
                                             threshold_algorithm=dlspark.AdaptiveThreshold(initial=1e-2))
        else:
            master = dlspark.ParameterAveraging(batch_size_per_worker=args.batch_size, averaging_frequency=2)
        # No client: the trainer starts an embedded LocalCluster sized to this machine and closes it.
        with dlspark.DistributedTrainer(None, net, master) as trainer:
            trainer.fit(train, epochs=args.epochs)
            evaluation = trainer.evaluate(test)
            if args.sharing:
                c = trainer.communication
                print(f"bytes sent {c['bytes_sent']:,} vs dense fp32 {c['dense_bytes']:,}")
    print(evaluation.stats())
    print(f"test accuracy {evaluation.accuracy():.4f}  test loss {net.score(test):.4f}  iterations {net.iteration}")
    if args.save:
        net.save(args.save)
        print(f"saved to {args.save}")
    return evaluation.accuracy()


if __name__ == "__main__":
    main()
