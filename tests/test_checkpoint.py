import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import optax
import pytest
from conftest import MLP, BNNet, tree_equal

from dlspark import Network
from dlspark.errors import CheckpointError


@pytest.mark.parametrize("where", ["memory", "local"])
def test_checkpoint_round_trip_is_bit_exact_and_training_continues_identically(make_net, digits, tmp_path, where):
    tr, _ = digits
    url = "memory://ckpt/net.dls" if where == "memory" else str(tmp_path / "sub" / "net.dls")
    module = MLP(dropout=0.2)
    straight = make_net(module, updater=optax.adam(3e-3))
    straight.fit(tr, epochs=4, batch_size=64, shuffle=True)

    first = make_net(module, updater=optax.adam(3e-3))
    first.fit(tr, epochs=2, batch_size=64, shuffle=True)
    first.save(url)
    loaded = Network.load(url)
    assert tree_equal(loaded.state, first.state)
    assert (loaded.iteration, loaded.epoch) == (first.iteration, first.epoch)
    loaded.fit(tr, epochs=2, batch_size=64, shuffle=True)
    assert tree_equal(loaded.state, straight.state)

    restored = make_net(module, updater=optax.adam(3e-3)).restore(url)
    assert tree_equal(restored.state, first.state)


def test_model_state_round_trips(make_net, digits):
    tr, _ = digits
    net = make_net(BNNet())
    net.fit(tr, epochs=1, batch_size=64)
    net.save("memory://ckpt/bn.dls")
    back = Network.load("memory://ckpt/bn.dls")
    assert tree_equal(back.state.model_state, net.state.model_state)
    np.testing.assert_array_equal(back.output(tr.features[:10]), net.output(tr.features[:10]))


def test_load_needs_no_user_code(tmp_path):
    # The model class lives in a user module that the loading process cannot import.
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "mymodel.py").write_text(textwrap.dedent("""
        import flax.linen as nn
        class Tiny(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(3)(x)
    """))
    save = textwrap.dedent(f"""
        import sys, numpy as np, optax
        sys.path.insert(0, {str(pkg)!r})
        from mymodel import Tiny
        import dlspark
        net = dlspark.Network(dlspark.Model.from_flax(Tiny(), np.zeros((1, 4), np.float32)),
                              loss="mse", updater=optax.sgd(0.1), seed=3)
        net.fit((np.ones((8, 4), np.float32), np.zeros((8, 3), np.float32)), batch_size=4)
        net.save({str(tmp_path / 'tiny.dls')!r})
        print(net.output(np.ones((1, 4), np.float32)).tolist())
    """)
    load = textwrap.dedent(f"""
        import numpy as np, dlspark
        try:
            import mymodel
        except ImportError:
            pass
        else:
            raise SystemExit("user module should not be importable here")
        net = dlspark.Network.load({str(tmp_path / 'tiny.dls')!r})
        print(net.output(np.ones((1, 4), np.float32)).tolist())
        assert net.iteration == 2
    """)
    a = subprocess.run([sys.executable, "-c", save], capture_output=True, text=True, cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    b = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, cwd="/")
    assert b.returncode == 0, b.stderr
    assert a.stdout == b.stdout


def test_bad_checkpoints_name_the_url_and_the_problem(make_net, tmp_path):
    net = make_net()
    good = tmp_path / "good.dls"
    net.save(str(good))
    raw = good.read_bytes()
    (tmp_path / "trunc.dls").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="trunc.dls.*not a zip archive"):
        Network.load(str(tmp_path / "trunc.dls"))
    (tmp_path / "text.dls").write_text("hello")
    with pytest.raises(CheckpointError, match="text.dls"):
        net.restore(str(tmp_path / "text.dls"))
    with pytest.raises(CheckpointError, match="missing.dls.*not found"):
        net.restore(str(tmp_path / "missing.dls"))
    other = make_net(MLP(hidden=16))
    with pytest.raises(CheckpointError, match=r"good.dls.*Dense_0.*shape \(64,\).*expects.*shape \(16,\)"):
        other.restore(str(good))
    sgd = make_net(updater=optax.sgd(0.1))
    with pytest.raises(CheckpointError, match="different architecture or updater"):
        sgd.restore(str(good))
    z = zipfile.ZipFile(tmp_path / "foreign.zip", "w")
    z.writestr("x.txt", "x")
    z.close()
    with pytest.raises(CheckpointError, match="needs dlspark.json"):
        net.restore(str(tmp_path / "foreign.zip"))


def test_restore_executes_nothing_from_the_file(make_net, tmp_path):
    net = make_net()
    url = str(tmp_path / "evil.dls")
    net.save(url)
    # Replace the definition with a pickle that would run code when loaded.
    with zipfile.ZipFile(url) as z:
        members = {n: z.read(n) for n in z.namelist()}
    marker = tmp_path / "pwned"
    members["definition.pkl"] = (
        b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    )
    with zipfile.ZipFile(url, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    net.restore(url)
    assert not marker.exists()


def test_a_state_moves_between_processes_as_arrays_checked_like_a_checkpoint(make_net, digits):
    # What a job's set-up, its final fetch and a joining worker move: the leaves' description
    # and host copies of the arrays (Dask sends them as frames), read back bit for bit and
    # checked leaf by leaf as a checkpoint's are.
    import jax
    import jax.numpy as jnp
    from distributed.protocol import deserialize, serialize

    from dlspark.checkpoint import state_from_arrays, state_to_arrays

    tr, _ = digits
    net = make_net(updater=optax.adam(1e-2))
    net.fit(tr[:64], batch_size=32)
    payload = state_to_arrays(net.state)
    assert [a.nbytes for a in payload["arrays"]] == [np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(net.state)]
    # the arrays are copies: the state's buffers may be donated to the next step at once
    assert not any(np.shares_memory(a, np.asarray(x)) for a, x in zip(payload["arrays"], jax.tree_util.tree_leaves(net.state)))
    back = state_from_arrays(deserialize(*serialize(payload)), net.state)
    assert tree_equal(back, net.state)
    # an extended dtype travels as its bytes and comes back as itself
    half = net.state.replace(params=jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), net.state.params))
    back = state_from_arrays(deserialize(*serialize(state_to_arrays(half))), half)
    assert tree_equal(back, half) and jax.tree_util.tree_leaves(back.params)[0].dtype == jnp.bfloat16

    other = make_net(MLP(hidden=16))
    with pytest.raises(CheckpointError, match=r"checkpoint .the state from worker w.: array .* has shape \(16,\) .* expects .* with shape \(64,\)"):
        state_from_arrays(state_to_arrays(other.state), net.state, "the state from worker w")
    wrong = dict(payload, arrays=[a.astype(np.float64) if a.dtype == np.float32 else a for a in payload["arrays"]])
    with pytest.raises(CheckpointError, match="came with shape .* and dtype float64, described as .* float32"):
        state_from_arrays(wrong, net.state)
    with pytest.raises(CheckpointError, match="describes .* arrays but holds"):
        state_from_arrays(dict(payload, arrays=payload["arrays"][:-1]), net.state)


def test_load_checkpoint_builds_with_the_constructor_it_is_given(make_net, tmp_path):
    # the checkpoint format sits below Network: it builds with what it is handed, and names it when missing
    from dlspark.checkpoint import load_checkpoint

    net = make_net(seed=5)
    url = str(tmp_path / "n.dls")
    net.save(url)
    built = []

    def build(definition):
        built.append(definition["seed"])
        return Network.from_definition(definition)

    back = load_checkpoint(url, build)
    assert built == [5] and tree_equal(back.state.params, net.state.params)
    with pytest.raises(TypeError, match=r"load_checkpoint needs from_definition.*Network.load\(url\)"):
        load_checkpoint(url)
