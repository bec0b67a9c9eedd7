"""The data-pipeline state: which samples a run consumed, resumable on any topology (torch-free but for ``loading``)."""
