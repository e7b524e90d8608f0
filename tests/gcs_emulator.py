"""gcp-storage-emulator as the tests start it (tests/gcs_server.py), with the one precondition of Cloud
Storage that moe-tpu relies on and the emulator ignores: an upload with ifGenerationMatch=0 creates the
object only where none is, and answers 412 Precondition Failed where one is (as Cloud Storage does; what
`data prepare`'s lock on a gs:// dataset stands on). Run as a script with the emulator's own arguments."""

import sys
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_insert = objects.insert


def insert(request, response, storage, *args, **kwargs):
    if (request.query.get("ifGenerationMatch") or [None])[0] == "0":
        name = (request.query.get("name") or [None])[0]
        if name is None and isinstance(request.data, dict):
            name = (request.data.get("meta") or {}).get("name")
        try:
            storage.get_file_obj(request.params["bucket_name"], name)
        except NotFound:
            pass
        else:
            response.status = HTTPStatus.PRECONDITION_FAILED
            message = "At least one of the pre-conditions you specified did not hold."
            response.json({"error": {"code": 412, "message": message, "errors": [{"reason": "conditionNotMet"}]}})
            return None
    return _insert(request, response, storage, *args, **kwargs)


objects.insert = insert  # before the server module builds its routes from the handlers

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main

    main(sys.argv[1:])
