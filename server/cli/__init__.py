"""``ba-run``'s command line (``main``) and its status lines and exit codes (``status``)."""
