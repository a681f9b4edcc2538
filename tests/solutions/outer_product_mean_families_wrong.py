"""As outer_product_mean_families.py, but FAMILIES["boltz"] is a Boltz-named module that normalises as
AlphaFold does (outer_product_mean_boltz_eps.py): judged against the Boltz reference it must fail, and
ModelNew against the default reference still passes."""
import importlib.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_families_wrong_{name}", os.path.join(_HERE, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ModelNew = _load("outer_product_mean_good").ModelNew
FAMILIES = {"openfold": _load("outer_product_mean_openfold_good").ModelNew,
            "boltz": _load("outer_product_mean_boltz_eps").ModelNew}
