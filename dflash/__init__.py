"""dflash: train DFlash speculative-decoding drafters from offline target hidden states."""

__version__ = "0.1.0"
