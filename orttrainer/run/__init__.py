"""The recipe runner behind `orttrainer train`: a recipe (YAML) becomes data, a Hugging Face model and an
ORTTrainer, and the loop trains, evaluates and checkpoints it; uses only the public trainer API.
"""
