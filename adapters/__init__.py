"""Model adapters of elsa_vision (installed as ``elsa_vision.adapters``): one file per model family,
registered by module class in registry.py."""
