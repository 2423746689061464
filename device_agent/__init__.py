"""The mobizo device agent: lease jobs, train locally, upload only LoRA-B."""
