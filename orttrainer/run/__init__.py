"""The recipe runner behind `orttrainer train`: a recipe (YAML) becomes data, a Hugging Face model and an
ORTTrainer, which the loop trains, evaluates and checkpoints; built on the legacy API, never the engine.
"""
