"""One-off measurement harnesses from past work, kept because they reproduce a result still quoted (each module's
first docstring line says which). Run as `python -m experiments.<name>`; bench/gpu_check.sh drives them on a GPU.
The user CLIs are in bench/."""
