"""Ray Data's messages that are not the user's concern, silenced in the process that runs a stream (#15 item 6).

INFO lines per dataset execution, and the once-per-process warning "Progress bars disabled. To enable, ..." that
Ray Data prints because rlflow turns its bars off on purpose (the run prints its own progress line).
"""

import logging


def quiet_ray_data() -> None:
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
