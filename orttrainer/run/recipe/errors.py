"""RecipeError: what every part of the recipe runner raises for a bad recipe or override."""


class RecipeError(ValueError):
    """An invalid recipe or command-line override; `lines` holds one readable line per problem."""

    def __init__(self, lines, source=None):
        if isinstance(lines, str):
            lines = [lines]
        self.lines = list(lines)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + line for line in self.lines))
