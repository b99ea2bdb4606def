"""Built-in methods, one package each: `config.py`, `drafter.py` and whatever else the method needs, registered
in the package's `__init__` (`register_method`). `hf_spec.core.registry` imports a package the first time its method
is asked for, so importing one method (or the engine) imports no other."""
