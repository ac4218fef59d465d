"""Where the broker keeps things: the one-writer SQLite store, its schema and migrations, and
the content-addressed artifact store with the holdings that keep its blobs alive."""
