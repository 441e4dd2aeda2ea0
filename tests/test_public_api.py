import importlib

import pytest

MODULES = ["dlspark", "dlspark.data", "dlspark.datasets", "dlspark.losses", "dlspark.io", "dlspark.errors",
           "dlspark.checkpoint", "dlspark.compat", "dlspark.distributed", "dlspark.evaluation", "dlspark.cluster",
           "dlspark.cli", "dlspark.testing"]


@pytest.mark.parametrize("modname", MODULES)
def test_every_exported_name_imports_and_has_a_docstring(modname):
    mod = importlib.import_module(modname)
    assert mod.__doc__, f"{modname} has no module docstring"
    for name in mod.__all__:
        obj = getattr(mod, name)
        if callable(obj) or isinstance(obj, type) or hasattr(obj, "__file__"):
            assert obj.__doc__, f"{modname}.{name} has no docstring"


def test_compat_is_a_subpackage_and_claims_no_top_level_name(tmp_path):
    import subprocess
    import sys

    # Run outside the source tree, so only the installed distribution is seen.
    code = (
        "import importlib.util, dlspark.compat; "
        "assert dlspark.compat.__name__ == 'dlspark.compat'; "
        "print(importlib.util.find_spec('compat'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"
