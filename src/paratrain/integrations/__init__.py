"""Adapters for other frameworks' training loops: Lightning's Strategy (`integrations.lightning`,
the `lightning` extra). Hugging Face models need none: `paratrain.prepare` takes them as they are
(examples/hf_prepare.py). Each adapter imports its framework, so import the module you use."""
