"""Training: the one config of every option (config), the methods (methods), a run from data to adapter (training), evaluation and its report (evaluate), and export (export)."""
