"""The fleet pipeline: many gateways' retained state -> fleet tables.

    edgebroker fleet collect --inventory FLEET.json --out SNAPSHOTS/
    edgebroker fleet synth --gateways N --topics M --snapshots K --out SNAPSHOTS/
    edgebroker fleet build --snapshots SNAPSHOTS/ --out WAREHOUSE/ [--master local[*]]
    edgebroker fleet report WAREHOUSE/ [--html FILE]

Modules (the snapshot layout and every table's columns are in schema.py):

    schema     the snapshot row schema (Arrow) and the warehouse table names
    props      MQTT 5.0 property bytes -> content type, payload format, user properties
    mqtt5      a small asyncio MQTT 5.0 client that gathers retained messages
    inventory  the inventory and secrets files -> Gateway entries with resolved limits
    collect    `fleet collect`: bounded concurrency, timeout + retry, collect log
    decode     executor-side readers: snapshot Parquet and flash store files -> Arrow
    job        the PySpark build job (`fleet build`; spark-submit runs this module)
    synth      synthetic snapshots for scale tests and the benchmark
    report     terminal summary and a self-contained HTML page (inline SVG)

Only job.py and spark.py import pyspark; decode.py is what the executors run
(it imports pyarrow, the standard library and lib/edgestore.py).
"""
