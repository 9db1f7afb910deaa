"""Cerberus helpers (private) shared by the options, model_desc and recipe schemas.
"""
