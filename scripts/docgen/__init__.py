"""The generated reference pages (scripts/gen_reference.py) and the documentation command check
(tests/docs/test_doc_commands.py): their shared parts."""
