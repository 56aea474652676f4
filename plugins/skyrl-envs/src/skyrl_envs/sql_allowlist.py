"""What a model's SQL may do: an authorizer allowing reads, listed functions and listed pragmas.

Everything not listed here is refused, so a function or pragma added by a newer SQLite, an
extension or a compile option is refused until someone reviews it. Reviewed and left out on
purpose: ``fts3_tokenizer`` (returns a library pointer; with a pointer argument it makes the next
FTS3 ``MATCH`` call into arbitrary memory), ``fts5`` (returns an API pointer), the FTS auxiliary
functions (``matchinfo``, ``offsets``, ``snippet``, ``highlight``, ``bm25``) and ``match``,
``load_extension``, ``zeroblob`` and ``randomblob`` (megabytes from a few characters),
``sqlite_compileoption_*``, ``sqlite_offset``, ``sqlite_source_id``, ``sqlite_version``,
``changes``, ``last_insert_rowid``, ``total_changes`` (nothing to learn from them here), and
every pragma that changes the connection or shows more than a table's shape (``writable_schema``,
``query_only``, ``temp_store``, ``cache_size``, ``mmap_size``, ``hard_heap_limit``,
``database_list``, ``function_list``, ...). Pragmas are checked as statements and as table-valued
functions (``SELECT * FROM pragma_table_info('t')``): SQLite asks the authorizer for both.
"""

from __future__ import annotations

import sqlite3

ALLOWED_FUNCTIONS = frozenset("""
    abs char coalesce concat concat_ws format glob hex ifnull iif instr length like likelihood likely
    lower ltrim max min nullif octet_length printf quote random replace round rtrim sign soundex substr
    substring trim typeof unhex unicode unlikely upper
    avg count group_concat string_agg sum total
    row_number rank dense_rank percent_rank cume_dist ntile lag lead first_value last_value nth_value
    date time datetime julianday unixepoch strftime timediff
    acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln log log10 log2 mod pi
    pow power radians sin sinh sqrt tan tanh trunc
    json json_array json_array_length json_error_position json_extract json_insert json_object json_patch
    json_quote json_remove json_replace json_set json_type json_valid json_group_array json_group_object
    -> ->>
""".split())
ALLOWED_PRAGMAS = frozenset({"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo",
                             "foreign_key_list"})
_READING_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, getattr(sqlite3, "SQLITE_RECURSIVE", 33)}


class ReadOnlyAuthorizer:
    """The authorizer callback; ``refusal`` says what the last refused action was, for the error."""

    def __init__(self) -> None:
        self.refusal = ""

    def __call__(self, action: int, arg1: str | None, arg2: str | None, db_name: str | None,
                 trigger: str | None) -> int:
        if action in _READING_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in ALLOWED_FUNCTIONS:
                return sqlite3.SQLITE_OK
            self.refusal = f"{arg2} is not an allowed function"
        elif action == sqlite3.SQLITE_PRAGMA:
            if (arg1 or "").lower() in ALLOWED_PRAGMAS:  # each only reads; its argument names a table or index
                return sqlite3.SQLITE_OK
            self.refusal = f"PRAGMA {arg1}{'' if arg2 is None else ' = ' + arg2} is not an allowed pragma"
        else:
            self.refusal = "only reading queries are allowed (the database is read-only)"
        return sqlite3.SQLITE_DENY

