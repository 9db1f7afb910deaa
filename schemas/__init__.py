"""Validation schemas (YAML data), shipped as the package `orttrainer.schemas`."""
