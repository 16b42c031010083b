"""Speed, memory and quality measurements of kvcompress (and of kvpress beside it); shared helpers in ``common``."""
