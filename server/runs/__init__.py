"""A run folder: its format (``folder``), the recorder that writes it, its checkpoint, provenance,
partitions and experiment tracker, its listing and comparison (``ba-run --list/--compare``) and
its figures (``plots``)."""
