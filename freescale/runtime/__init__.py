"""What every job runs on, below the data path: the error types and exit codes (`errors`,
`job_errors`), one declaration per option (`options`), paths and URIs (`paths`, `hadoop_fs`),
writing all or nothing (`atomic_output`, `json_files`), logs, locks and stop signals, and Spark's
session, master check, errors and progress lines. Standard library only at import, except
`session` (pyspark).
"""
