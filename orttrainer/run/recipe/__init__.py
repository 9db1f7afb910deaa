"""Recipes (`orttrainer train`): the YAML schema and its checks, the model section, and the data a recipe
trains on.
"""
