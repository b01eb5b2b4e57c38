"""``ba-sweep``: a spec file (``spec``), its runs (``run``, the console script) and its report
(``report``)."""
