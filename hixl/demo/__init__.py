"""The PD-disaggregation demo (``hixl demo``); needs the ``demo`` extra (torch, transformers)."""
