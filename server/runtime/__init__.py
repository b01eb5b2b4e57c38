"""Where a run runs: Flower's simulation (a SuperLink and Ray, ``simulation``) or this process
(``inprocess``), started by ``launch``; the Flower processes' environment and stopping
(``processes``), the FAB's staging (``staging``) and the run's console (``watch``)."""
