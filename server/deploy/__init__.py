"""A real Flower deployment: ``ba-deploy local`` (``local``), ``ba-supernode`` (``supervise``),
``ba-warm-executor`` (``warm_executor``), what each process cost (``resources``) and what the
installed Flower release offers (``flower_release``)."""
