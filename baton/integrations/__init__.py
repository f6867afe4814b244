"""Running a framework's training loop under Baton: the Hugging Face `Trainer` (`hf`),
Accelerate (`accelerate`) and Lightning (`lightning`), each on `baton.runtime.external`.

Each module imports its framework, so each is imported only by an entry point that uses it
(`pip install baton[hf]`, `[accelerate]`, `[lightning]`); nothing else in Baton imports
this package's modules.
"""
