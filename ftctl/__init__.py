"""``ftctl``, the operator CLI, and the client library it is a thin layer over."""
