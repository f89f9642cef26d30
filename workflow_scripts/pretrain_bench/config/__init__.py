"""The config: the schema's loader, defaults and validation, and the typed settings of each block (schema; the
train block, whose checks need the engines, is train.settings), and the checks the schema
cannot express that need no model code (checks)."""
