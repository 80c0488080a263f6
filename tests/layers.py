"""The package's layers, bottom to top, by module name relative to the package: read from the source by
tests/unit/test_layers.py, and from a running worker by tests/test_worker_imports.py."""

from __future__ import annotations

# Bottom to top. The wire layer is what a worker may import; `worker` sits on it alone.
LAYERS: list[tuple[str, set[str]]] = [
    ("wire", {"errors", "params", "chat", "_frames", "_opbase", "protocol", "shm", "variants", "_files", "metrics",
              "models", "_futures", "_pieces"}),
    ("worker", {"worker", "worker.sandbox", "worker.landlock", "worker.grammar_trie", "worker.engine",
                "worker.registry", "worker.file_checks", "worker.memory_cap", "worker.model_handlers",
                "worker.context_handlers", "worker.generation_handlers", "worker.scoring_handlers",
                "worker.branch_handlers", "worker.state_handlers", "worker.zygote", "worker.loop",
                "worker.__main__"}),
    ("transport", {"_launch", "_process", "_watch", "_aio"}),
    # A context's lifecycle, in one owner per worker: pure bookkeeping (journal, the generation and context
    # machines, the residency policy), a state outside its worker, and the core that drives them.
    ("core", {"_journal", "_generation", "_residency", "_states", "_calls", "_machine", "_image", "_jobs", "_core"}),
    # What runs on one context. A context makes its conversations (Context.chat) and names its adapters;
    # _owners: the model and worker that own the handles, as Protocols (a handle cannot import its owner).
    ("handles", {"_owners", "stream", "branches", "sampler", "lora", "session", "context"}),
    ("serving", {"scheduler", "batching", "routing"}),
    # A model makes its contexts and its batcher; an instance holds the models and routes batched calls.
    ("models", {"model", "migration", "_batched", "instance"}),
    ("features", {"_embedder"}),
    ("pool", {"lifecycle", "spares", "snapshot", "pool"}),
    # "" is lloyal_pool/__init__.py: the public names, loaded lazily (so importing it for __version__ is free).
    ("fronts", {"client", "serve", "serve.app", "serve.backend", "serve.schemas", "serve.telemetry", "ray", "cli",
                "__main__", ""}),
]

# The worker imports only the wire layer and its own package, whatever their rank says.
WORKER_MAY_IMPORT = {"wire", "worker"}
