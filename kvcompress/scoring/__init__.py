"""Importance scores: observed attention (H2O, SnapKV), their aggregation, and value norms (CriticalKV)."""
