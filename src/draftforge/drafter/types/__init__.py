"""The built-in drafter types, one module each, registered with `drafter.registry.register_drafter_type`
(docs/architecture.md, "Drafter types"). The registry imports these modules on its first lookup; they are
torch-free (model and config classes are named as "module:attr" strings, imported on use).
"""
