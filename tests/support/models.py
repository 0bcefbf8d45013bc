"""The tiny test models' architectures (scripts/make_test_model.py), for parametrizing."""

import make_test_model

ARCHITECTURES = list(make_test_model.ARCHITECTURES)
MOE = [name for name, spec in make_test_model.ARCHITECTURES.items() if make_test_model.moe_layers(spec, 1)]
