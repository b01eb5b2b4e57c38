"""The ServerApp (``app.py``), its run configuration, strategy factory and round loop; the run
folder (``runs/``), the runtimes that launch a run (``runtime/``), ``ba-run`` (``cli/``),
``ba-sweep`` (``sweep/``) and ``ba-deploy`` (``deploy/``)."""
