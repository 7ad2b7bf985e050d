"""What every bench shares, so that none imports another bench: options (`args`), MuSiQue (`data`), the
question sets (`sets`), an engine here (`engine`), servers started here (`servers`) and the HTTP calls to
them (`client`), a process's memory (`memory`), statistics (`stats`), fidelity (`fidelity`), the JSON out
(`output`), Postgres (`postgres`)."""
