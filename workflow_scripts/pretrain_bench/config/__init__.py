"""The config: the schema's loader, defaults and validation (schema), the typed settings of each block (schema,
settings for `train.*`), the whole experiment built once after validation (experiment), and the checks the schema
cannot express that need no model code (checks)."""
